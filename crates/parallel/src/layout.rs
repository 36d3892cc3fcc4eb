//! The layout of a training run: how many workers along each parallel dimension (dp × tp ×
//! pp × cp), and the settings that decide how a step runs on them (ZeRO stage, micro-batches,
//! pipeline schedule, recomputation, precision).
//!
//! A layout is plain data. It parses the strings the planner prints (`meshtrain plan`; the
//! grammar is [`meshtrain_plan::layout::layout_terms`]) and prints one that both the planner
//! and `meshtrain train --layout` read back. [`Layout::resolve`] checks it against the world
//! size, the global batch and the model *before any work starts*, and names the numbers when
//! they do not fit.

use crate::engine::{Schedule, ScheduleKind};
use meshtrain_nn::Model;
pub use meshtrain_plan::cluster::Precision;
pub use meshtrain_plan::layout::Recompute;
use meshtrain_plan::layout::{layout_terms, parse_flag};
use std::fmt;
use std::str::FromStr;

/// How the dimensions and step settings of a run are chosen. `Default` is one worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Data-parallel replicas.
    pub dp: usize,
    /// Tensor-parallel workers per replica (Megatron-style layers).
    pub tp: usize,
    /// Pipeline stages per replica.
    pub pp: usize,
    /// Context-parallel workers (sequence chunks).
    pub cp: usize,
    /// Sequence parallelism inside the tensor-parallel regions.
    pub sp: bool,
    /// ZeRO stage over the data-parallel group (0 = none).
    pub zero: u8,
    /// Samples per micro-batch (`mb=`, the planner's unit)...
    pub micro_batch_size: Option<usize>,
    /// ...or micro-batches per replica and step (`m=`); with neither, one micro-batch.
    pub micro_batches: Option<usize>,
    pub schedule: ScheduleKind,
    pub recompute: Recompute,
    pub precision: Precision,
}

impl Default for Layout {
    fn default() -> Self {
        Layout {
            dp: 1,
            tp: 1,
            pp: 1,
            cp: 1,
            sp: false,
            zero: 0,
            micro_batch_size: None,
            micro_batches: None,
            schedule: ScheduleKind::OneFOneB,
            recompute: Recompute::None,
            precision: Precision::Fp32,
        }
    }
}

/// Why a layout cannot run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    #[error("layout '{layout}': {reason}")]
    Parse { layout: String, reason: String },
    #[error("{0}")]
    Invalid(String),
    #[error("{what} is not available yet: {why}")]
    NotYet { what: String, why: &'static str },
}

impl Layout {
    /// Workers the layout needs: dp × tp × pp × cp.
    pub fn world_size(&self) -> usize {
        self.dp * self.tp * self.pp * self.cp
    }

    /// A data-parallel layout of `dp` replicas.
    pub fn data_parallel(dp: usize) -> Self {
        Layout {
            dp,
            ..Layout::default()
        }
    }

    /// Checks the layout against a world of `world` workers, a global batch of
    /// `global_batch` samples and `model`, and fixes the micro-batch count. Everything that
    /// cannot run fails here, before any worker starts, with the numbers in the message.
    pub fn resolve(
        &self,
        world: usize,
        global_batch: usize,
        model: &Model,
    ) -> Result<ResolvedLayout, LayoutError> {
        let invalid = |s: String| Err(LayoutError::Invalid(s));
        for (name, v) in [
            ("dp", self.dp),
            ("tp", self.tp),
            ("pp", self.pp),
            ("cp", self.cp),
        ] {
            if v == 0 {
                return invalid(format!("{name} must be at least 1"));
            }
        }
        if self.world_size() != world {
            return invalid(format!(
                "dp={} × tp={} × pp={} × cp={} = {} but the world has {world} workers",
                self.dp,
                self.tp,
                self.pp,
                self.cp,
                self.world_size()
            ));
        }
        self.check_implemented()?;
        // What every context-parallel mode needs (Ulysses' heads are checked where the mode
        // is known: `parallelize`, `Job::check` and the command's config check); first, since
        // tensor parallelism's sequence check divides by cp.
        crate::context::check_sequence(model, self.cp)
            .map_err(|e| LayoutError::Invalid(e.to_string()))?;
        crate::tensor::check(model, self.tp, self.sp, self.cp)
            .map_err(|e| LayoutError::Invalid(e.to_string()))?;
        let m = self.micro_batch_count(global_batch)?;
        let schedule = Schedule::new(self.schedule, self.pp, m).map_err(|e| {
            LayoutError::Invalid(format!("pipeline layout pp={} m={m}: {e}", self.pp))
        })?;
        let (blocks, stages) = (model.num_blocks(), schedule.num_chunks());
        if stages > blocks {
            return invalid(format!(
                "pp={} × {} chunk(s) per worker = {stages} stages, but the model has only \
                 {blocks} blocks to cut",
                self.pp,
                self.schedule.chunks_per_worker()
            ));
        }
        Ok(ResolvedLayout {
            layout: Layout {
                micro_batches: Some(m),
                micro_batch_size: Some(global_batch / (self.dp * m)),
                ..self.clone()
            },
            schedule,
        })
    }

    /// Micro-batches per replica and step for a global batch of `global_batch`.
    fn micro_batch_count(&self, global_batch: usize) -> Result<usize, LayoutError> {
        let per_replica = global_batch / self.dp;
        let m = match (self.micro_batches, self.micro_batch_size) {
            (Some(0), _) => return Err(LayoutError::Invalid("m must be at least 1".into())),
            (_, Some(0)) => return Err(LayoutError::Invalid("mb must be at least 1".into())),
            (Some(m), Some(size)) if m * size * self.dp != global_batch => {
                return Err(LayoutError::Invalid(format!(
                    "m={m} micro-batches of mb={size} samples × dp={} = {} samples, but the \
                     global batch is {global_batch}",
                    self.dp,
                    m * size * self.dp
                )))
            }
            (Some(m), _) => m,
            (None, Some(size)) => {
                if !global_batch.is_multiple_of(self.dp * size) {
                    return Err(LayoutError::Invalid(format!(
                        "the global batch of {global_batch} samples does not split into dp={} \
                         replicas × micro-batches of mb={size} samples",
                        self.dp
                    )));
                }
                per_replica / size
            }
            (None, None) => 1,
        };
        if !global_batch.is_multiple_of(self.dp * m) {
            return Err(LayoutError::Invalid(format!(
                "train.batch_size {global_batch} must divide evenly over dp={} replicas × {m} \
                 micro-batches",
                self.dp
            )));
        }
        Ok(m)
    }

    /// Dimensions and settings whose modules do not exist yet fail clearly instead of being
    /// silently ignored.
    fn check_implemented(&self) -> Result<(), LayoutError> {
        let not_yet = |what: String, why| Err(LayoutError::NotYet { what, why });
        if self.sp && self.tp == 1 {
            return Err(LayoutError::Invalid(
                "sp (sequence parallelism) splits the tensor-parallel regions' tokens: it \
                 needs tp > 1"
                    .into(),
            ));
        }
        if self.zero >= 2 && self.pp > 1 {
            return not_yet(
                format!("zero={} with pp={}", self.zero, self.pp),
                "ZeRO-2/3 reduce and gather per block inside the pipeline's interleaved \
                 passes; with a pipeline use zero=1 (Megatron's distributed optimizer)",
            );
        }
        if self.recompute == Recompute::Selective {
            return not_yet(
                "recompute=selective".into(),
                "only whole-block recomputation exists (recompute=full)",
            );
        }
        Ok(())
    }
}

impl Layout {
    /// `base` with the keys `text` names replaced (see [`Layout::from_str`] for the
    /// grammar): a config's layout amended by a `--layout` string. Naming `mb` drops the
    /// base's micro-batch count and naming `m` its micro-batch size.
    pub fn parse_onto(base: Layout, text: &str) -> Result<Layout, LayoutError> {
        let bad = |reason: String| LayoutError::Parse {
            layout: text.to_string(),
            reason,
        };
        let mut layout = base;
        let (mut interleave, mut one_f_one_b) = (None, None);
        for (key, value) in layout_terms(text).map_err(bad)? {
            let number = || {
                value
                    .parse::<usize>()
                    .map_err(|_| bad(format!("`{key}` needs a whole number, got `{value}`")))
            };
            match key.as_str() {
                "dp" => layout.dp = number()?,
                "tp" => layout.tp = number()?,
                "pp" => layout.pp = number()?,
                "cp" => layout.cp = number()?,
                "mb" | "micro_batch" => {
                    layout.micro_batch_size = Some(number()?);
                    layout.micro_batches = None;
                }
                "m" | "micro_batches" => {
                    layout.micro_batches = Some(number()?);
                    layout.micro_batch_size = None;
                }
                "v" | "interleave" => interleave = Some(number()?),
                "zero" => {
                    layout.zero = u8::try_from(number()?)
                        .ok()
                        .filter(|z| *z <= 3)
                        .ok_or_else(|| bad("zero must be 0, 1, 2 or 3".into()))?
                }
                "sp" => layout.sp = parse_flag(&value).map_err(bad)?,
                "recompute" => layout.recompute = Recompute::parse(&value).map_err(bad)?,
                "precision" => {
                    layout.precision =
                        crate::precision::parse_trainer_precision(&value).map_err(bad)?
                }
                "schedule" => one_f_one_b = Some(value == "1f1b"),
                other => return Err(bad(format!("unknown key `{other}`"))),
            }
        }
        if interleave.is_some() || one_f_one_b.is_some() {
            let base_v = layout.schedule.chunks_per_worker();
            let one_f_one_b =
                one_f_one_b.unwrap_or(!matches!(layout.schedule, ScheduleKind::GPipe));
            layout.schedule = match (one_f_one_b, interleave.unwrap_or(base_v)) {
                (_, 0) => return Err(bad("v must be at least 1".into())),
                (true, 1) => ScheduleKind::OneFOneB,
                (true, v) => ScheduleKind::Interleaved {
                    chunks_per_worker: v,
                },
                (false, 1) => ScheduleKind::GPipe,
                (false, _) => return Err(bad("gpipe has one chunk per worker (v=1)".into())),
            };
        }
        Ok(layout)
    }
}

impl FromStr for Layout {
    type Err = LayoutError;

    /// `dp=2,pp=2,mb=4,schedule=1f1b`, or what `meshtrain plan` prints (`dp=2 tp=1 pp=2
    /// zero=0 mb=4 recompute=none 1f1b`). Keys: dp, tp, pp, cp, sp, zero, mb (samples per
    /// micro-batch), m (micro-batches per replica), schedule (gpipe, 1f1b, interleaved:V),
    /// v (chunks per worker), recompute (none, full), precision (fp32, bf16, fp16, fp8).
    fn from_str(text: &str) -> Result<Self, LayoutError> {
        Layout::parse_onto(Layout::default(), text)
    }
}

impl fmt::Display for Layout {
    /// The canonical form: comma-separated, default dimensions left out (dp always shown),
    /// read back by [`Layout::from_str`] and by `meshtrain plan --layout`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "dp={}", self.dp)?;
        for (name, v) in [("tp", self.tp), ("pp", self.pp), ("cp", self.cp)] {
            if v > 1 {
                write!(f, ",{name}={v}")?;
            }
        }
        if self.sp {
            write!(f, ",sp=on")?;
        }
        if self.zero > 0 {
            write!(f, ",zero={}", self.zero)?;
        }
        match (self.micro_batch_size, self.micro_batches) {
            (Some(size), _) => write!(f, ",mb={size}")?,
            (None, Some(m)) => write!(f, ",m={m}")?,
            (None, None) => {}
        }
        if self.pp > 1 {
            match self.schedule {
                ScheduleKind::GPipe => write!(f, ",schedule=gpipe")?,
                ScheduleKind::OneFOneB => write!(f, ",schedule=1f1b")?,
                ScheduleKind::Interleaved { chunks_per_worker } => {
                    write!(f, ",schedule=interleaved:{chunks_per_worker}")?
                }
            }
        }
        if self.recompute != Recompute::None {
            write!(f, ",recompute={}", self.recompute.name())?;
        }
        if self.precision != Precision::Fp32 {
            write!(f, ",precision={}", self.precision.name())?;
        }
        Ok(())
    }
}

/// A layout checked against a world, a batch and a model, with its micro-batch count and
/// size fixed and its pipeline schedule built.
#[derive(Clone, Debug, PartialEq)]
pub struct ResolvedLayout {
    pub layout: Layout,
    pub schedule: Schedule,
}

impl ResolvedLayout {
    /// Micro-batches per replica and step.
    pub fn micro_batches(&self) -> usize {
        self.schedule.micro_batches
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshtrain_nn::layers::Linear;
    use meshtrain_nn::Block;

    fn model(blocks: usize) -> Model {
        Model::new(
            (0..blocks)
                .map(|i| Block::new(&format!("l{i}"), Linear::new(2, 2, true)))
                .collect(),
        )
    }

    #[test]
    fn parses_its_own_and_the_planners_form() {
        let l: Layout = "dp=2,pp=2,mb=4,schedule=1f1b".parse().unwrap();
        assert_eq!((l.dp, l.pp, l.micro_batch_size), (2, 2, Some(4)));
        assert_eq!(l.to_string(), "dp=2,pp=2,mb=4,schedule=1f1b");
        assert_eq!(l.to_string().parse::<Layout>().unwrap(), l);
        let planner: Layout = "dp=2 tp=1 pp=4 zero=0 mb=1 recompute=full 1f1b-interleaved(v=2)"
            .parse()
            .unwrap();
        assert_eq!(
            planner.schedule,
            ScheduleKind::Interleaved {
                chunks_per_worker: 2
            }
        );
        assert_eq!(planner.recompute, Recompute::Full);
        assert_eq!(
            planner.to_string(),
            "dp=2,pp=4,mb=1,schedule=interleaved:2,recompute=full"
        );
        // What a run prints, the planner reads.
        let back = meshtrain_plan::layout::Layout::parse(&planner.to_string()).unwrap();
        assert_eq!((back.dp, back.pp, back.interleave), (2, 4, 2));
        let e = "dp=2,xp=3".parse::<Layout>().unwrap_err().to_string();
        assert!(e.contains("unknown key `xp`"), "{e}");
        let e = "zero=7".parse::<Layout>().unwrap_err().to_string();
        assert!(e.contains("zero must be 0, 1, 2 or 3"), "{e}");
        // Amending a config's layout: only the named keys change.
        let base = Layout {
            dp: 2,
            micro_batches: Some(4),
            ..Layout::default()
        };
        let amended = Layout::parse_onto(base, "pp=2,mb=8").unwrap();
        assert_eq!((amended.dp, amended.pp), (2, 2));
        assert_eq!(
            (amended.micro_batches, amended.micro_batch_size),
            (None, Some(8))
        );
        assert_eq!(amended.schedule, ScheduleKind::OneFOneB);
    }

    #[test]
    fn resolve_names_the_numbers() {
        let m = model(4);
        let err = |text: &str, world: usize, batch: usize| {
            text.parse::<Layout>()
                .unwrap()
                .resolve(world, batch, &m)
                .unwrap_err()
                .to_string()
        };
        assert!(
            err("dp=2,pp=3", 4, 12).contains("dp=2 × tp=1 × pp=3 × cp=1 = 6 but the world has 4")
        );
        assert!(err("pp=5", 5, 10).contains("5 stages, but the model has only 4 blocks"));
        assert!(err("dp=2,m=4", 2, 12).contains("must divide evenly over dp=2 replicas × 4"));
        assert!(err("dp=2,mb=4", 2, 12).contains("does not split into dp=2 replicas"));
        assert!(err("pp=2,m=3,schedule=interleaved", 2, 12).contains("multiple of the number"));
        assert!(err("tp=2", 2, 8).contains("tp=2: the model has no tensor-parallel plan"));
        assert!(err("sp=on", 1, 8).contains("needs tp > 1"));
        assert!(err("dp=2,pp=2,zero=2", 4, 8).contains("zero=2 with pp=2 is not available yet"));
        assert!("dp=2,pp=2,zero=1"
            .parse::<Layout>()
            .unwrap()
            .resolve(4, 8, &m)
            .is_ok());
        let mixed = "precision=fp16".parse::<Layout>().unwrap();
        assert_eq!(
            mixed.resolve(1, 8, &m).unwrap().layout.precision,
            Precision::Fp16
        );
        let ok = "dp=2,pp=2,mb=2"
            .parse::<Layout>()
            .unwrap()
            .resolve(4, 16, &m)
            .unwrap();
        assert_eq!(ok.micro_batches(), 4);
        assert_eq!(ok.layout.to_string(), "dp=2,pp=2,mb=2,schedule=1f1b");
        let one = Layout::data_parallel(2).resolve(2, 16, &m).unwrap();
        assert_eq!(
            (one.micro_batches(), one.layout.micro_batch_size),
            (1, Some(8))
        );
    }
}
