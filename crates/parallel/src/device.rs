//! What a run on a GPU needs around the one step (the engine's, for both devices): the
//! checks before any work (the machine, the precision the GPU has tensor cores for, the
//! layers' kernels), the collectives that take device buffers (NCCL with one GPU per rank,
//! else staged through host memory), placing each chunk's state on the device
//! ([`crate::engine::DeviceState`]), and the boundary around a step where a device error
//! becomes an error and an out-of-memory becomes advice on what would fit.
//!
//! Once placed, the host keeps no copy of a chunk's state: checkpoints read the device a
//! bounded piece at a time (`Parallel::read_state`), loading writes it a tensor at a time
//! (`Parallel::write_state`), and what needs the whole state on the host (a gather-first
//! whole file, the evaluation hook) fills the stage's stores for as long as it runs
//! (`Parallel::pull_from_device`, then `release_host_state`), so checkpoints keep their one
//! format and a GPU run resumes on the CPU and the reverse.

use crate::data::GradSync;
use crate::engine::{DeviceState, PipelineError, Stage, StageChunk, StandIn};
use crate::layout::Layout;
use crate::{DeviceCheck, ParallelError, ParallelOptions};
use meshtrain_comm::ProcessGroup;
use meshtrain_nn::optim::Optimizer;
use meshtrain_nn::Model;
use meshtrain_tensor::{DType, Device};
use std::sync::Arc;

#[cfg(feature = "cuda")]
use meshtrain_tensor::cuda::{CudaDevice, CudaError, F32Math};

#[cfg(feature = "cuda")]
fn device_error(e: CudaError) -> ParallelError {
    ParallelError::Device(e.to_string())
}

/// Refuses, before any work, what this machine's GPU cannot run, in the order a user can act
/// on it: a missing driver or library and a GPU that does not exist first (the machine), then
/// a model with a layer that has no CUDA kernels or a shape they do not take (named). With
/// [`DeviceCheck::Opening`] it then opens the GPU (its context; a compute capability below
/// 8.0 is refused there, and fp8 without FP8 tensor cores).
pub fn check(
    model: &Model,
    layout: &Layout,
    device: Device,
    how: DeviceCheck,
) -> Result<(), ParallelError> {
    let Device::Cuda(ordinal) = device else {
        return Ok(());
    };
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (model, layout, how, ordinal);
        Err(ParallelError::Device(
            "this meshtrain was built without the `cuda` feature: rebuild with default \
             features for --device cuda"
                .into(),
        ))
    }
    #[cfg(feature = "cuda")]
    {
        meshtrain_tensor::cuda::probe::require_gpu(ordinal).map_err(device_error)?;
        refuse_what_gpus_cannot_run(model, ordinal)?;
        if how == DeviceCheck::Opening {
            let gpu = CudaDevice::get(ordinal).map_err(device_error)?;
            let fp8 = layout.precision == crate::precision::Precision::Fp8;
            if fp8 && !gpu.has_fp8_tensor_cores() {
                return Err(ParallelError::Device(format!(
                    "precision fp8 needs FP8 tensor cores (Ada or Hopper, compute capability \
                     8.9 or later); GPU {ordinal} ({}) is sm_{}: train with bf16",
                    gpu.name(),
                    gpu.arch()
                )));
            }
        }
        Ok(())
    }
}

/// What this build's GPU step cannot run on any machine: a model with a layer that has no
/// CUDA kernels, or a shape its kernels do not take (named, with the way out). Every
/// layout's dimensions and data-parallel settings have their device forms.
#[cfg(feature = "cuda")]
fn refuse_what_gpus_cannot_run(model: &Model, ordinal: usize) -> Result<(), ParallelError> {
    let device = Device::Cuda(ordinal);
    for (i, block) in model.blocks.iter().enumerate() {
        let name = if block.name.is_empty() {
            format!("block {i}")
        } else {
            format!("block {i} ({})", block.name)
        };
        if let Some((leaf, why)) = first_refusal(block.layer.as_ref(), &block.name, device) {
            return Err(ParallelError::Device(format!(
                "{name}: '{leaf}' cannot train on a GPU: {why}; change the model's shape, or \
                 train it with --device cpu"
            )));
        }
        if !block.layer.runs_on(device) {
            let leaf = first_cpu_only_leaf(block.layer.as_ref(), &block.name, device);
            return Err(ParallelError::Device(format!(
                "{name} has a layer without CUDA kernels ({leaf}; GPU kernels exist for the \
                 built-in layers: linear, convolution, batch norm, pooling, layer and RMS \
                 norm, activations and SwiGLU, token embeddings, rotary positions and \
                 attention; a layer of your own runs on a GPU when its `runs_on` says so and \
                 its forward and backward take device tensors): train this model with \
                 --device cpu"
            )));
        }
    }
    Ok(())
}

/// Which collectives a GPU run's world uses, for the run's first lines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceCollectives {
    /// One process (or thread) per GPU: NCCL, on the device buffers as they are.
    Nccl,
    /// Ranks sharing a GPU, or no NCCL: each operation's device buffers copied through
    /// pinned host memory and reduced by the host backend (correct, slow).
    Staged,
}

/// The collectives for ranks on `places` (each rank's host and GPU): NCCL when no two share
/// a GPU and `nccl` (the library loads), else staged (NCCL refuses two ranks on one GPU).
/// Pipelines and ring attention send point to point on NCCL too: their groups give each
/// pair that sends a communicator of its own
/// ([`ProcessGroup::prepare_point_to_point`](meshtrain_comm::ProcessGroup::prepare_point_to_point)),
/// so a stage's activations and its neighbour's gradients, which cross, do not wait for
/// each other.
pub fn choose_collectives(places: &[(u32, u32)], nccl: bool) -> DeviceCollectives {
    let mut distinct = places.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    if nccl && distinct.len() == places.len() {
        DeviceCollectives::Nccl
    } else {
        DeviceCollectives::Staged
    }
}

/// The world a run on `options.device` trains over: `world` itself on the CPU or for one
/// worker; for several workers on GPUs, NCCL for device buffers (host buffers staying on
/// `world`) when every rank has a GPU of its own and the machine has libnccl, else `world`
/// staged through host memory (as on the stand-in device of tests) ([`choose_collectives`]).
/// Every rank of `world` calls it.
pub fn collectives_for(
    world: Arc<dyn ProcessGroup>,
    options: &ParallelOptions,
) -> Result<(Arc<dyn ProcessGroup>, Option<DeviceCollectives>), ParallelError> {
    if world.size() == 1 {
        return Ok((world, None));
    }
    if options.stand_in_device {
        let memory = Arc::new(crate::engine::device::StandInMemory);
        return Ok((
            meshtrain_comm::StagedGroup::new(world, memory),
            Some(DeviceCollectives::Staged),
        ));
    }
    let Device::Cuda(ordinal) = options.device else {
        return Ok((world, None));
    };
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinal;
        Err(ParallelError::Device(
            "this meshtrain was built without the `cuda` feature".into(),
        ))
    }
    #[cfg(feature = "cuda")]
    {
        use meshtrain_comm::{
            nccl_available, BufMut, CudaMemory, NcclGroup, RoutedGroup, StagedGroup,
        };
        let dev = CudaDevice::get(ordinal).map_err(device_error)?;
        // Each rank's (host, GPU): NCCL refuses two ranks on one GPU.
        let host = world
            .config()
            .hosts
            .host_of(world.global_ranks()[world.rank()]);
        let mine = [host as f32, ordinal as f32];
        let mut all = vec![0.0f32; 2 * world.size()];
        world.all_gather(meshtrain_comm::BufRef::F32(&mine), BufMut::F32(&mut all))?;
        let places: Vec<(u32, u32)> = all.chunks(2).map(|p| (p[0] as u32, p[1] as u32)).collect();
        let chosen = choose_collectives(&places, nccl_available().is_ok());
        if chosen == DeviceCollectives::Nccl {
            // NCCL for the gradients; the step's host numbers (losses, flags, counts) stay on
            // the host group.
            let config = world.config().clone();
            let nccl = NcclGroup::from_bootstrap(world.as_ref(), dev, config)?;
            let routed = RoutedGroup::new(world, nccl)?;
            return Ok((routed, Some(DeviceCollectives::Nccl)));
        }
        let staged = StagedGroup::new(world, CudaMemory::new(dev));
        Ok((staged, Some(DeviceCollectives::Staged)))
    }
}

/// One chunk's state on the run's device, from its store and optimizer.
type PlaceChunk<'m> =
    Box<dyn Fn(&StageChunk, &Optimizer) -> Result<Box<dyn DeviceState>, PipelineError> + 'm>;

/// Places every chunk of `stage` on the run's device (`options.device`, or the host-backed
/// stand-in of tests): its state from the chunk's store and `optimizers`, the 16-bit copy
/// in `precision`, with the data-parallel mode `sync` told before (to hand over what it
/// holds outside the stores) and after (to put its own buffers there). Nothing on the CPU.
pub fn place(
    model: &Model,
    stage: &mut Stage,
    optimizers: &mut [Optimizer],
    options: &ParallelOptions,
    precision: DType,
    sync: &mut dyn GradSync,
) -> Result<(), ParallelError> {
    let place_chunk: PlaceChunk<'_> = if options.stand_in_device {
        Box::new(|chunk, opt| {
            let state = StandIn::place(model, chunk.blocks.clone(), &chunk.store, opt)?;
            Ok(Box::new(state) as Box<dyn DeviceState>)
        })
    } else if let Device::Cuda(ordinal) = options.device {
        place_on_gpu(model, ordinal, options, precision)?
    } else {
        return Ok(());
    };
    sync.placing(&mut stage.chunks);
    for (chunk, opt) in stage.chunks.iter_mut().zip(optimizers) {
        chunk.device = Some(place_chunk(chunk, opt)?);
        chunk.release_host_state(opt);
    }
    caught("placing the data-parallel buffers on the GPU", || {
        sync.placed(&mut stage.chunks)
    })
}

/// How a chunk's state goes to GPU `ordinal`, once the GPU is set up for the run.
#[cfg(feature = "cuda")]
fn place_on_gpu<'m>(
    model: &'m Model,
    ordinal: usize,
    options: &ParallelOptions,
    precision: DType,
) -> Result<PlaceChunk<'m>, ParallelError> {
    let dev = CudaDevice::get(ordinal).map_err(device_error)?;
    dev.set_f32_math(if options.tf32 {
        F32Math::Tf32
    } else {
        F32Math::Exact
    });
    dev.set_memory_limit(
        options
            .memory_limit_mb
            .map(|mb| (mb * 1024.0 * 1024.0) as usize),
    );
    dev.load_all_kernels().map_err(device_error)?;
    Ok(Box::new(move |chunk, opt| {
        let state = crate::engine::cuda_chunk::CudaChunk::place(
            &dev,
            model,
            chunk.blocks.clone(),
            &chunk.store,
            opt,
            precision,
        )?;
        Ok(Box::new(state) as Box<dyn DeviceState>)
    }))
}

#[cfg(not(feature = "cuda"))]
fn place_on_gpu<'m>(
    _: &'m Model,
    _: usize,
    _: &ParallelOptions,
    _: DType,
) -> Result<PlaceChunk<'m>, ParallelError> {
    Err(ParallelError::Device(
        "this meshtrain was built without the `cuda` feature".into(),
    ))
}

/// Runs `f` (device work outside a step: a data-parallel mode's own buffers placed beside
/// the chunks' states) so that an error raised on the device inside it (an out-of-memory
/// above all) becomes an error naming `what`, instead of a silent exit.
pub fn caught(what: &str, f: impl FnOnce()) -> Result<(), ParallelError> {
    #[cfg(feature = "cuda")]
    {
        meshtrain_tensor::cuda::error::catch(f)
            .map_err(|e| ParallelError::Device(format!("{what}: {e}")))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = what;
        f();
        Ok(())
    }
}

/// What a worker holds on its device beside a step's activations, and what sharding more of
/// it would free (for out-of-memory advice).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatesOnDevice {
    /// Bytes of model states (parameters with their 16-bit copy, gradients, moments).
    pub bytes: usize,
    /// A ZeRO stage this run could take on its device, over how many ranks, and the bytes
    /// per rank it would free.
    pub sharding: Option<ShardingRoom>,
}

/// See [`StatesOnDevice::sharding`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardingRoom {
    pub stage: u8,
    pub ranks: usize,
    pub frees: usize,
}

/// Runs `f` (a step or an evaluation over `samples` samples, beside `states`) so that an
/// error raised on the device inside it becomes an error: an out-of-memory says what batch
/// would fit, and what a ZeRO stage would free.
pub fn guarded<T>(
    samples: usize,
    states: StatesOnDevice,
    f: impl FnOnce() -> Result<T, ParallelError>,
) -> Result<T, ParallelError> {
    #[cfg(feature = "cuda")]
    {
        match meshtrain_tensor::cuda::error::catch(f) {
            Ok(r) => r,
            Err(CudaError::OutOfMemory { oom }) => {
                Err(ParallelError::Device(out_of_memory(&oom, samples, states)))
            }
            Err(e) => Err(device_error(e)),
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (samples, states);
        f()
    }
}

/// The path of the first leaf layer under `layer` (at `path`) without kernels for `device`,
/// children named by their names or, unnamed, by their place (`blocks.0.#2`).
#[cfg(feature = "cuda")]
fn first_cpu_only_leaf(layer: &dyn meshtrain_nn::Layer, path: &str, device: Device) -> String {
    let Some(children) = layer.children() else {
        return if path.is_empty() {
            "the block's own layer".into()
        } else {
            format!("'{path}'")
        };
    };
    for (i, (name, child)) in children.layers().iter().enumerate() {
        if !child.runs_on(device) {
            return first_cpu_only_leaf(child.as_ref(), &child_path(path, i, name), device);
        }
    }
    format!("'{path}'")
}

/// The path of child `i` (named `name`, or unnamed) of the layer at `path`: `blocks.0.#2`.
#[cfg(feature = "cuda")]
fn child_path(path: &str, i: usize, name: &str) -> String {
    let part = if name.is_empty() {
        format!("#{i}")
    } else {
        name.to_string()
    };
    if path.is_empty() {
        part
    } else {
        format!("{path}.{part}")
    }
}

/// The first layer under `layer` (at `path`, named as [`first_cpu_only_leaf`] names them)
/// whose kernels for `device` do not take its shape, with its reason
/// ([`meshtrain_nn::Layer::refusal_on`]).
#[cfg(feature = "cuda")]
fn first_refusal(
    layer: &dyn meshtrain_nn::Layer,
    path: &str,
    device: Device,
) -> Option<(String, String)> {
    if let Some(why) = layer.refusal_on(device) {
        return Some((path.to_string(), why));
    }
    let children = layer.children()?;
    children
        .layers()
        .iter()
        .enumerate()
        .find_map(|(i, (name, child))| {
            first_refusal(child.as_ref(), &child_path(path, i, name), device)
        })
}

/// An allocation that failed in a step, with what would fit: the step's activations grow
/// with the samples per step, so a batch scaled by the room left over what the step held
/// when it failed (a lower bound on its need) is the largest that could fit.
#[cfg(feature = "cuda")]
fn out_of_memory(
    oom: &meshtrain_tensor::cuda::alloc::OutOfMemory,
    samples: usize,
    states: StatesOnDevice,
) -> String {
    let limit = oom.limit.unwrap_or(oom.in_use + oom.free);
    let room = limit.saturating_sub(states.bytes) as f64;
    let needed = (oom.in_use + oom.bytes).saturating_sub(states.bytes).max(1) as f64;
    let fits = ((samples as f64) * room / needed).floor() as usize;
    let sharded = states.sharding.map(|s| {
        let fits = ((samples as f64) * (room + s.frees as f64) / needed).floor() as usize;
        format!(
            "; with ZeRO stage {stage} (parallel.zero = {stage}: each of the {ranks} ranks keeps \
             the optimizer moments of its pieces only) {:.0} MiB more per GPU would be free, \
             room for about {fits} samples per step",
            s.frees as f64 / (1u64 << 20) as f64,
            stage = s.stage,
            ranks = s.ranks,
        )
    });
    let advice = if fits >= 1 {
        format!(
            "at most about {fits} samples per step (of {samples}) would fit: lower \
             train.batch_size, or keep the batch and split it with train.accumulation_steps, \
             or recompute activations (train.recompute = true)"
        )
    } else {
        "not even one sample per step fits beside the model states (parameters, gradients, \
         optimizer moments): the model is too large for this GPU alone"
            .to_string()
    };
    format!(
        "{}; {advice}{}",
        CudaError::OutOfMemory { oom: oom.clone() },
        sharded.unwrap_or_default()
    )
}

#[cfg(test)]
mod placement_tests {
    use super::*;

    #[test]
    fn nccl_when_every_rank_has_its_own_gpu_else_staged() {
        use DeviceCollectives::{Nccl, Staged};
        // Two hosts of two GPUs each: the same GPU number on two hosts is two GPUs.
        let own = [(0, 0), (0, 1), (1, 0), (1, 1)];
        assert_eq!(choose_collectives(&own, true), Nccl);
        assert_eq!(choose_collectives(&own, false), Staged, "no libnccl");
        // Ranks sharing a GPU (the lent machine, launch --gpus 1 --np 2).
        assert_eq!(choose_collectives(&[(0, 0), (0, 0)], true), Staged);
        assert_eq!(choose_collectives(&[(0, 0), (0, 1), (0, 1)], true), Staged);
    }
}

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::*;
    use meshtrain_nn::models::gpt::gpt;
    use meshtrain_nn::models::lenet::lenet;
    use meshtrain_nn::models::{GptConfig, LeNetVariant};
    use meshtrain_tensor::cuda::alloc::OutOfMemory;

    /// A shape the GPU's kernels do not take is refused before any work, naming the layer,
    /// the reason and the shape: attention's heads 16 wide (64 / 4), where the kernels take
    /// 32, 64 and 128; the default GPT's 64-wide heads pass.
    #[test]
    fn attention_heads_the_kernels_do_not_take_are_named_before_work() {
        refuse_what_gpus_cannot_run(&gpt(&GptConfig::default()), 0).unwrap();
        let narrow = GptConfig {
            dim: 64,
            heads: 4,
            ..GptConfig::default()
        };
        let e = refuse_what_gpus_cannot_run(&gpt(&narrow), 0)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("block 1")
                && e.contains("cannot train on a GPU")
                && e.contains("heads are 16 wide (dim 64 / 4 heads)")
                && e.contains("[32, 64, 128]"),
            "{e}"
        );
    }

    /// Without the driver, that is said first, whatever else the GPU could not run: it is
    /// what the user can act on (a layout of two workers, a model without kernels come after).
    #[test]
    fn a_missing_driver_is_named_first() {
        if meshtrain_tensor::cuda::probe::require_driver().is_ok() {
            eprintln!("skipped: this machine has the NVIDIA driver");
            return;
        }
        let layout = Layout {
            dp: 2,
            ..Layout::default()
        };
        for model in [gpt(&GptConfig::default()), lenet(LeNetVariant::Relu)] {
            for how in [DeviceCheck::WithoutOpening, DeviceCheck::Opening] {
                let e = check(&model, &layout, Device::Cuda(0), how)
                    .unwrap_err()
                    .to_string();
                assert!(
                    e.starts_with("--device cuda needs the NVIDIA driver (libcuda.so.1)")
                        && e.ends_with("without a GPU, train with --device cpu"),
                    "{e}"
                );
            }
        }
    }

    /// A user's layer that says nothing about devices: CPU only (the trait's default).
    struct HostOnly;

    impl meshtrain_nn::layer::Layer for HostOnly {
        fn forward(
            &self,
            _: meshtrain_nn::layer::Params<'_>,
            _: meshtrain_nn::layer::ParamsMut<'_>,
            x: meshtrain_tensor::Tensor,
            _: meshtrain_nn::layer::Mode,
            _: &mut meshtrain_nn::layer::Saved,
        ) -> meshtrain_tensor::Tensor {
            x
        }

        fn backward(
            &self,
            _: meshtrain_nn::layer::Params<'_>,
            _: meshtrain_nn::layer::ParamsMut<'_>,
            _: meshtrain_nn::layer::Saved,
            dy: meshtrain_tensor::Tensor,
            _: bool,
        ) -> Option<meshtrain_tensor::Tensor> {
            Some(dy)
        }
    }

    #[test]
    fn a_layer_without_cuda_kernels_is_named() {
        let mut model = lenet(LeNetVariant::Relu);
        model
            .blocks
            .insert(1, meshtrain_nn::model::Block::new("mine", HostOnly));
        let e = refuse_what_gpus_cannot_run(&model, 0)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("block 1 (mine)") && e.contains("without CUDA kernels"),
            "{e}"
        );
        assert!(e.contains("--device cpu"), "{e}");
    }

    /// The conv nets have CUDA kernels for every layer: convolutions, batch norm, pooling,
    /// the layout changes, ResNet's residual join.
    #[test]
    fn the_conv_nets_pass_the_per_layer_check() {
        for model in [
            lenet(LeNetVariant::Relu),
            lenet(LeNetVariant::Sigmoid),
            meshtrain_nn::models::resnet::resnet18(8, 10),
        ] {
            assert!(refuse_what_gpus_cannot_run(&model, 0).is_ok());
        }
    }

    /// A Llama has CUDA kernels for every layer (token-only embedding, RMS norms, rotary +
    /// GQA, attention, SwiGLU, linears): the per-layer check passes.
    #[test]
    fn a_llama_passes_the_per_layer_check() {
        let cfg = meshtrain_nn::models::LlamaConfig {
            vocab: 64,
            // Heads 32 wide: a size the training attention kernels take.
            dim: 128,
            layers: 1,
            heads: 4,
            kv_heads: 2,
            ffn: 48,
            seq: 8,
            rope_theta: 1e4,
            rope_scaling: None,
            norm_eps: 1e-5,
            tie_embeddings: false,
            attention: Default::default(),
            qkv_bias: false,
            head_dim: None,
            qk_norm: false,
            sliding_window: None,
        };
        let model = meshtrain_nn::models::llama::llama(&cfg);
        assert!(model
            .blocks
            .iter()
            .all(|b| b.layer.runs_on(Device::Cuda(0))));
        assert!(model.blocks.iter().all(|b| b.layer.runs_on(Device::Cpu)));
        assert!(refuse_what_gpus_cannot_run(&model, 0).is_ok());
    }

    #[test]
    fn the_gpt_runs_on_a_gpu_layer_by_layer() {
        let model = gpt(&GptConfig::default());
        assert!(model
            .blocks
            .iter()
            .all(|b| b.layer.runs_on(Device::Cuda(0))));
        assert!(model.blocks.iter().all(|b| b.layer.runs_on(Device::Cpu)));
    }

    #[test]
    fn out_of_memory_says_what_batch_would_fit() {
        let gib = 1usize << 30;
        let oom = OutOfMemory {
            what: "a linear layer's output".into(),
            bytes: 2 * gib,
            in_use: 30 * gib,
            free: gib,
            total: 80 * gib,
            limit: None,
        };
        // 10 GiB of states; the step held 20 GiB of activations and wanted 2 more for 32
        // samples; 21 GiB of room beside the states → about 30 samples.
        let states = StatesOnDevice {
            bytes: 10 * gib,
            sharding: None,
        };
        let text = out_of_memory(&oom, 32, states);
        assert!(
            text.contains("a linear layer's output needs 2048.0 MiB"),
            "{text}"
        );
        assert!(
            text.contains("at most about 30 samples per step (of 32)"),
            "{text}"
        );
        assert!(!text.contains("ZeRO"), "{text}");
        // DDP over 4 ranks with 8 GiB of moments each: ZeRO-1 would free 6 GiB, room for
        // 27 GiB / 22 GiB × 32 ≈ 39 samples.
        let dp4 = StatesOnDevice {
            sharding: Some(ShardingRoom {
                stage: 1,
                ranks: 4,
                frees: 6 * gib,
            }),
            ..states
        };
        let text = out_of_memory(&oom, 32, dp4);
        assert!(
            text.contains(
                "with ZeRO stage 1 (parallel.zero = 1: each of the 4 ranks keeps the optimizer \
                 moments of its pieces only) 6144 MiB more per GPU would be free, room for about \
                 39 samples per step"
            ),
            "{text}"
        );
        let tiny = OutOfMemory {
            in_use: 10 * gib,
            free: 0,
            ..oom
        };
        let text = out_of_memory(&tiny, 32, states);
        assert!(text.contains("not even one sample"), "{text}");
    }
}
