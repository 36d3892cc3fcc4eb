//! The memory model against a published record of layouts that ran or ran out of memory.
//!
//! Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
//! (arXiv 2205.05198, <https://arxiv.org/abs/2205.05198>), trained four GPT models (Table 3:
//! 22B, 175B, 530B, 1T; s = 2048, V = 51200, A100-80GB, mixed precision with Adam, the
//! standard attention kernel, dp = 1) on fixed tensor × pipeline layouts. Figure 1 shows that
//! storing every activation (tensor and pipeline parallelism, no recomputation) needs more than
//! the 80 GB of an A100 for all four, while sequence parallelism with selective recomputation
//! ("present work") fits; Table 5 reports the step times of both the present work and full
//! recomputation on those layouts, so both ran. That gives twelve layouts: four that ran out
//! of memory and eight that ran. Nothing here is fitted to them: each row is the paper's model
//! shape and layout put through [`Problem::evaluate`] with the a100-80gb preset.

use std::fmt;

use crate::cluster::{Precision, GIB};
use crate::error::Result;
use crate::layout::{Layout, Recompute, TrainingSetup};
use crate::presets;
use crate::Problem;

/// Where the rows come from.
pub const SOURCE: &str = "Korthikanti et al. 2022, Reducing Activation Recomputation in Large \
Transformer Models, Table 3 (configurations), Figure 1 (no recomputation exceeds 80 GB) and \
Table 5 (runs with full and with selective recomputation), https://arxiv.org/abs/2205.05198";

/// One model of Table 3 with the layout the paper ran it on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PaperModel {
    pub name: &'static str,
    pub heads: u64,
    pub hidden: u64,
    pub layers: u64,
    pub tp: u64,
    pub pp: u64,
    pub gpus: u64,
    pub global_batch: u64,
    pub micro_batch: u64,
}

/// Table 3 of Korthikanti et al. 2022.
pub const TABLE3: [PaperModel; 4] = [
    PaperModel {
        name: "22B",
        heads: 64,
        hidden: 6144,
        layers: 48,
        tp: 8,
        pp: 1,
        gpus: 8,
        global_batch: 4,
        micro_batch: 4,
    },
    PaperModel {
        name: "175B",
        heads: 96,
        hidden: 12288,
        layers: 96,
        tp: 8,
        pp: 8,
        gpus: 64,
        global_batch: 64,
        micro_batch: 1,
    },
    PaperModel {
        name: "530B",
        heads: 128,
        hidden: 20480,
        layers: 105,
        tp: 8,
        pp: 35,
        gpus: 280,
        global_batch: 280,
        micro_batch: 1,
    },
    PaperModel {
        name: "1T",
        heads: 160,
        hidden: 25600,
        layers: 128,
        tp: 8,
        pp: 64,
        gpus: 512,
        global_batch: 512,
        micro_batch: 1,
    },
];

/// The three ways the paper stores activations, and whether each ran (Figure 1, Table 5).
pub const VARIANTS: [(&str, bool, Recompute, bool); 3] = [
    ("tp+pp, no recomputation", false, Recompute::None, false),
    (
        "sp + selective recomputation",
        true,
        Recompute::Selective,
        true,
    ),
    ("full recomputation", false, Recompute::Full, true),
];

/// One published layout and what the planner predicts for it.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryCase {
    pub model: &'static str,
    pub variant: &'static str,
    pub layout: Layout,
    /// Published: the layout trained (true) or did not fit (false).
    pub ran: bool,
    pub predicted_fits: bool,
    pub predicted_gib: f64,
}

/// Predicts every row of the table.
pub fn korthikanti_2022() -> Result<Vec<MemoryCase>> {
    let mut cases = Vec::new();
    for m in TABLE3 {
        let name = format!("gpt-{}", m.name);
        let model = crate::validation::megatron_gpt(&name, m.layers, m.hidden, m.heads);
        let cluster = presets::cluster("a100-80gb")?.with_gpus(m.gpus)?;
        // Megatron accumulates and reduces gradients in fp32 (its `main_grad` buffer).
        let setup = TrainingSetup {
            fp32_gradients: true,
            ..TrainingSetup::new(m.global_batch, Precision::Bf16)
        };
        let problem = Problem::new(model, cluster, setup)?;
        for (variant, sp, recompute, ran) in VARIANTS {
            let layout = Layout {
                tp: m.tp,
                pp: m.pp,
                sp,
                micro_batch: m.micro_batch,
                recompute,
                ..Layout::data_parallel(1, m.micro_batch)
            };
            let e = problem.evaluate(&layout)?;
            cases.push(MemoryCase {
                model: m.name,
                variant,
                layout,
                ran,
                predicted_fits: e.fits,
                predicted_gib: e.memory.total() / GIB,
            });
        }
    }
    Ok(cases)
}

/// Predicted fits / out of memory against published ran / out of memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Confusion {
    pub ran_predicted_fits: usize,
    pub ran_predicted_oom: usize,
    pub oom_predicted_fits: usize,
    pub oom_predicted_oom: usize,
}

impl Confusion {
    pub fn of(cases: &[MemoryCase]) -> Self {
        let mut c = Confusion::default();
        for case in cases {
            match (case.ran, case.predicted_fits) {
                (true, true) => c.ran_predicted_fits += 1,
                (true, false) => c.ran_predicted_oom += 1,
                (false, true) => c.oom_predicted_fits += 1,
                (false, false) => c.oom_predicted_oom += 1,
            }
        }
        c
    }

    pub fn total(&self) -> usize {
        self.ran_predicted_fits
            + self.ran_predicted_oom
            + self.oom_predicted_fits
            + self.oom_predicted_oom
    }

    /// Share of rows where the prediction matches the published outcome.
    pub fn accuracy(&self) -> f64 {
        (self.ran_predicted_fits + self.oom_predicted_oom) as f64 / self.total() as f64
    }
}

impl fmt::Display for Confusion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "                 predicted fits  predicted OOM")?;
        writeln!(
            f,
            "published ran    {:>14}  {:>13}",
            self.ran_predicted_fits, self.ran_predicted_oom
        )?;
        writeln!(
            f,
            "published OOM    {:>14}  {:>13}",
            self.oom_predicted_fits, self.oom_predicted_oom
        )?;
        write!(
            f,
            "correct: {}/{} = {:.0}%",
            self.ran_predicted_fits + self.oom_predicted_oom,
            self.total(),
            100.0 * self.accuracy()
        )
    }
}
