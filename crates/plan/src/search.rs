//! Exhaustive search over layouts: dp × tp × pp × cp (and its mode) × sp × ZeRO × micro-batch
//! × recomputation × interleaving × schedule. Every candidate costs a few hundred floating-point operations, so
//! even tens of thousands of them take milliseconds.

use serde::Serialize;

use crate::cost::{Evaluation, Problem};
use crate::error::{PlanError, Result};
use crate::layout::{CpMode, Layout, Recompute, Schedule};

/// Outcome of a search.
#[derive(Debug, Clone, Serialize)]
pub struct SearchResult {
    /// Feasible layouts: the recommendation first (the simplest of the layouts predicted
    /// within [`TIE`] of the fastest, see [`rank`]), then all the others fastest (most
    /// tokens or samples per second, i.e. shortest step) first.
    pub ranked: Vec<Evaluation>,
    /// Layouts that could be built and were evaluated.
    pub candidates: usize,
    /// Of those, how many did not fit into memory.
    pub out_of_memory: usize,
    /// The infeasible layout needing the least memory, to explain a failure.
    pub closest_miss: Option<Evaluation>,
}

impl SearchResult {
    pub fn best(&self) -> Option<&Evaluation> {
        self.ranked.first()
    }
}

fn divisors(n: u64) -> Vec<u64> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

/// Powers of two dividing `n`, up to `limit`.
fn power_of_two_divisors(n: u64, limit: u64) -> Vec<u64> {
    let mut out = Vec::new();
    let mut b = 1;
    while b <= n && b <= limit {
        if n.is_multiple_of(b) {
            out.push(b);
        }
        b *= 2;
    }
    out
}

/// Largest micro-batch size the search tries: beyond it GEMMs are already large and only
/// memory grows.
const MAX_MICRO_BATCH: u64 = 64;
/// Largest number of interleaved model chunks per device the search tries.
const MAX_INTERLEAVE: u64 = 8;

/// A split of the cluster's GPUs.
struct Mesh {
    dp: u64,
    tp: u64,
    pp: u64,
    cp: u64,
}

/// Every dp·tp·pp·cp = N split with cp a power of two and the global batch divisible over the
/// replicas; models other than transformers get data parallelism only.
fn meshes(problem: &Problem) -> Vec<Mesh> {
    let n = problem.cluster.gpus;
    let splits_model = problem.model.transformer().is_some();
    let mut out = Vec::new();
    for tp in divisors(n) {
        for pp in divisors(n / tp) {
            for cp in power_of_two_divisors(n / (tp * pp), n) {
                let dp = n / (tp * pp * cp);
                if (splits_model || tp * pp * cp == 1)
                    && problem.setup.global_batch.is_multiple_of(dp)
                {
                    out.push(Mesh { dp, tp, pp, cp });
                }
            }
        }
    }
    out
}

/// All layouts the problem admits (before the memory check).
pub fn enumerate(problem: &Problem) -> Vec<Layout> {
    let transformer = problem.model.transformer().cloned();
    let mut out = Vec::new();
    for Mesh { dp, tp, pp, cp } in meshes(problem) {
        let per_replica = problem.setup.global_batch / dp;
        let sp_options: &[bool] = if tp > 1 { &[false, true] } else { &[false] };
        let recompute_options: &[Recompute] = if transformer.is_some() {
            &[Recompute::None, Recompute::Selective, Recompute::Full]
        } else {
            &[Recompute::None]
        };
        let interleave_options: Vec<u64> = match &transformer {
            Some(t) if pp > 1 && t.layers % pp == 0 => divisors(t.layers / pp)
                .into_iter()
                .filter(|v| *v <= MAX_INTERLEAVE)
                .collect(),
            _ => vec![1],
        };
        // With cp = 1 the mode means nothing: one placeholder.
        let cp_modes = match problem.setup.cp_mode {
            Some(mode) if cp > 1 => vec![mode],
            None if cp > 1 => vec![CpMode::Ring, CpMode::Ulysses],
            _ => vec![CpMode::Ring],
        };
        // ZeRO shards over the dp·cp ranks that reduce gradients together. With a pipeline,
        // ZeRO-2/3 pay their per-micro-batch reduce-scatters and (ZeRO-3) gathers of the
        // stage's layers in the time model (`data_parallel_comm`), so they compete fairly.
        let zero_stages = if dp * cp > 1 { 0..=3u8 } else { 0..=0 };
        for micro_batch in power_of_two_divisors(per_replica, MAX_MICRO_BATCH) {
            for &sp in sp_options {
                for zero in zero_stages.clone() {
                    for &recompute in recompute_options {
                        for &interleave in &interleave_options {
                            let schedules: &[Schedule] = if pp > 1 && interleave == 1 {
                                &[Schedule::OneFOneB, Schedule::GPipe]
                            } else {
                                &[Schedule::OneFOneB]
                            };
                            for &schedule in schedules {
                                for &cp_mode in &cp_modes {
                                    out.push(Layout {
                                        dp,
                                        tp,
                                        pp,
                                        cp,
                                        cp_mode,
                                        sp,
                                        zero,
                                        micro_batch,
                                        recompute,
                                        interleave,
                                        schedule,
                                    });
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

/// Evaluates one given layout. With cp > 1 and the mode left to the planner it tries ring and
/// Ulysses and returns the better (one that fits before one that does not, then the faster);
/// if neither can run, the error names both reasons.
pub fn evaluate_layout(problem: &Problem, layout: &Layout) -> Result<Evaluation> {
    let modes = match problem.setup.cp_mode {
        Some(mode) => vec![mode],
        None if layout.cp > 1 => vec![CpMode::Ring, CpMode::Ulysses],
        None => vec![layout.cp_mode],
    };
    let mut best: Option<Evaluation> = None;
    let mut reasons = Vec::new();
    for &cp_mode in &modes {
        match problem.evaluate(&Layout {
            cp_mode,
            ..layout.clone()
        }) {
            Ok(e) => {
                let better = best.as_ref().is_none_or(|b| {
                    (e.fits, e.throughput.samples_per_s) > (b.fits, b.throughput.samples_per_s)
                });
                if better {
                    best = Some(e);
                }
            }
            Err(PlanError::InvalidLayout { reason, .. }) if modes.len() > 1 => {
                reasons.push(format!("{}: {reason}", cp_mode.name()))
            }
            Err(other) => return Err(other),
        }
    }
    best.ok_or_else(|| PlanError::InvalidLayout {
        layout: layout.to_string(),
        reason: reasons.join("; "),
    })
}

/// Evaluates every buildable layout and ranks the ones that fit by predicted throughput.
pub fn search(problem: &Problem) -> Result<SearchResult> {
    let mut ranked = Vec::new();
    let mut candidates = 0;
    let mut out_of_memory = 0;
    let mut closest_miss: Option<Evaluation> = None;
    for layout in enumerate(problem) {
        // Layouts the model cannot be cut into (heads, layers) are skipped, not errors.
        let Ok(evaluation) = problem.evaluate(&layout) else {
            continue;
        };
        candidates += 1;
        if evaluation.fits {
            ranked.push(evaluation);
        } else {
            out_of_memory += 1;
            let smaller = closest_miss
                .as_ref()
                .is_none_or(|c| evaluation.memory.total() < c.memory.total());
            if smaller {
                closest_miss = Some(evaluation);
            }
        }
    }
    Ok(SearchResult {
        ranked: rank(ranked),
        candidates,
        out_of_memory,
        closest_miss,
    })
}

/// Predicted throughputs within this factor of each other are inside the cost model's
/// resolution: a layout at most 0.5% slower than the fastest counts as equally fast.
pub const TIE: f64 = 1.005;

/// Orders feasible layouts for printing and recommending: first the recommendation — of the
/// layouts predicted at most 0.5% ([`TIE`]) slower than the fastest, the simplest
/// ([`complexity`]), then the one with the most memory headroom, then the faster — and after
/// it every other layout fastest first (equal throughputs: simpler, then less memory). So the
/// step times after the first row never go down the list, and the first row is at most 0.5%
/// slower than the fastest layout (the second row when it is not the fastest itself).
///
/// (Sorting everything by 0.5% bands of throughput and by simplicity inside a band, as before,
/// printed slower layouts above faster ones all down the table.)
pub fn rank(mut ranked: Vec<Evaluation>) -> Vec<Evaluation> {
    let speed = |e: &Evaluation| e.throughput.samples_per_s;
    let simpler = |a: &Evaluation, b: &Evaluation| {
        complexity(&a.layout)
            .cmp(&complexity(&b.layout))
            .then(a.memory.total().total_cmp(&b.memory.total()))
    };
    ranked.sort_by(|a, b| speed(b).total_cmp(&speed(a)).then(simpler(a, b)));
    let Some(fastest) = ranked.first().map(speed) else {
        return ranked;
    };
    let recommended = ranked
        .iter()
        .enumerate()
        .take_while(|(_, e)| speed(e) * TIE >= fastest)
        .min_by(|(_, a), (_, b)| simpler(a, b).then(speed(b).total_cmp(&speed(a))))
        .map_or(0, |(i, _)| i);
    let best = ranked.remove(recommended);
    ranked.insert(0, best);
    ranked
}

/// How much machinery a layout needs: each extra parallel dimension, ZeRO stage,
/// recomputation level or interleaving adds one.
fn complexity(l: &Layout) -> u32 {
    u32::from(l.tp > 1)
        + u32::from(l.pp > 1)
        + u32::from(l.cp > 1)
        + u32::from(l.sp)
        + u32::from(l.zero)
        + match l.recompute {
            Recompute::None => 0,
            Recompute::Selective => 1,
            Recompute::Full => 2,
        }
        + u32::from(l.interleave > 1)
        + u32::from(l.schedule == Schedule::GPipe)
}

/// Like [`search`], but an empty result is an error naming the closest miss.
pub fn search_feasible(problem: &Problem) -> Result<SearchResult> {
    let result = search(problem)?;
    if result.ranked.is_empty() {
        let closest = match &result.closest_miss {
            Some(miss) => miss
                .clone()
                .require_fit(&problem.cluster)
                .err()
                .map_or_else(|| miss.layout.to_string(), |e| e.to_string()),
            None => "no layout can be built for this model and GPU count".to_string(),
        };
        return Err(PlanError::NoFeasibleLayout {
            candidates: result.candidates,
            closest,
        });
    }
    Ok(result)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::Precision;
    use crate::layout::{AttentionKind, TrainingSetup};
    use crate::presets;

    fn problem(model: &str, cluster: &str, gpus: u64, batch: u64) -> Problem {
        let c = presets::cluster(cluster).unwrap().with_gpus(gpus).unwrap();
        Problem::new(
            presets::model(model).unwrap(),
            c,
            TrainingSetup::new(batch, Precision::Bf16),
        )
        .unwrap()
    }

    #[test]
    fn ranked_results_fit_and_are_sorted() {
        let p = problem("gpt-30b", "h100", 32, 256);
        let r = search_feasible(&p).unwrap();
        assert!(r.candidates > 1000, "{}", r.candidates);
        // The recommendation is at most 0.5% slower than the fastest; the rest fastest first.
        let fastest = fastest_of(&r);
        assert!(r.ranked[0].throughput.samples_per_s * TIE >= fastest);
        for pair in r.ranked[1..].windows(2) {
            assert!(pair[1].throughput.samples_per_s <= pair[0].throughput.samples_per_s);
        }
        assert!(r.ranked.iter().all(|e| e.fits));
        // 30B with Adam needs 16 bytes/param = 480 GB of states: plain data parallelism on
        // 80 GB GPUs cannot be in the list.
        assert!(r
            .ranked
            .iter()
            .all(|e| !(e.layout.tp == 1 && e.layout.pp == 1 && e.layout.zero == 0)));
        let best = r.best().unwrap();
        assert!(best.memory.total() <= 80.0 * crate::cluster::GIB);
    }

    /// The highest predicted throughput among `r`'s layouts.
    fn fastest_of(r: &SearchResult) -> f64 {
        (r.ranked.iter())
            .map(|e| e.throughput.samples_per_s)
            .fold(0.0, f64::max)
    }

    #[test]
    fn small_cpu_models_get_data_parallelism() {
        let p = problem("resnet18", "cpu", 2, 256);
        let best = search_feasible(&p).unwrap().ranked[0].clone();
        assert_eq!((best.layout.dp, best.layout.tp, best.layout.pp), (2, 1, 1));
        // The recommendation is the simplest layout within 0.5% of the fastest.
        let r = search_feasible(&problem("gpt-30b", "h100", 32, 256)).unwrap();
        let fastest = fastest_of(&r);
        let best = r.best().unwrap();
        for e in r
            .ranked
            .iter()
            .filter(|e| e.throughput.samples_per_s * TIE >= fastest)
        {
            assert!(
                complexity(&best.layout) <= complexity(&e.layout),
                "{} before {}",
                best.layout,
                e.layout
            );
        }
    }

    /// Issue 28: `meshtrain plan --cluster cpu --model gpt` printed longer predicted steps
    /// above shorter ones all down its table (1.1830 s at #12 above 1.1798 s at #13 and
    /// 1.1786 s at #15): 0.5% throughput bands, simpler layouts first inside a band.
    #[test]
    fn layouts_after_the_recommendation_are_listed_fastest_first() {
        let c = presets::cluster("cpu").unwrap();
        let mut setup = TrainingSetup::new(64, Precision::Fp32);
        setup.attention = AttentionKind::Flash;
        let p = Problem::new(presets::model("gpt").unwrap(), c, setup).unwrap();
        let r = search_feasible(&p).unwrap();
        assert!(r.ranked.len() > 30, "{}", r.ranked.len());
        let steps: Vec<f64> = r.ranked.iter().map(|e| e.time.step_s).collect();
        for (i, pair) in steps[1..].windows(2).enumerate() {
            assert!(
                pair[0] <= pair[1],
                "#{} {} ({:.4} s) listed above the faster #{} {} ({:.4} s)",
                i + 2,
                r.ranked[i + 1].layout,
                pair[0],
                i + 3,
                r.ranked[i + 2].layout,
                pair[1]
            );
        }
        // The first row is the recommendation: at most 0.5% slower than the fastest, and no
        // layout that close is simpler.
        let fastest = fastest_of(&r);
        let best = r.best().unwrap();
        assert!(best.throughput.samples_per_s * TIE >= fastest);
        assert!(r
            .ranked
            .iter()
            .filter(|e| e.throughput.samples_per_s * TIE >= fastest)
            .all(|e| complexity(&best.layout) <= complexity(&e.layout)));
    }

    fn long_gpt_30b(attention: AttentionKind) -> Problem {
        let mut p = problem("gpt-30b", "h100", 8, 8);
        p.model = p.model.with_seq_len(32768).unwrap();
        p.setup.attention = attention;
        p
    }

    #[test]
    fn long_sequences_get_context_parallelism() {
        // A 30B GPT at s = 32768 on 8 × 80 GB with the kernel that keeps the probabilities
        // (56·32768² scores per layer): no layout without cp fits; ring attention's blocks
        // keep only log-sum-exps, and cp splits the rest.
        let p = long_gpt_30b(AttentionKind::Standard);
        let r = search_feasible(&p).unwrap();
        assert!(r.ranked.iter().all(|e| e.layout.cp > 1));
        assert!(enumerate(&p).iter().any(|l| l.cp == 1));
        let best = r.best().unwrap();
        assert_eq!(best.layout.cp_mode, CpMode::Ring);
        assert!(best
            .layout
            .to_string()
            .contains(&format!(" cp={} ", best.layout.cp)));
        // With the flash kernel cp = 1 layouts fit too (tp = 8 with sp splits as much), but
        // cp is faster: no tensor-parallel all-reduces, hops hidden under attention.
        let p = long_gpt_30b(AttentionKind::Flash);
        let r = search_feasible(&p).unwrap();
        assert!(r.ranked.iter().any(|e| e.layout.cp == 1));
        assert!(
            r.best().unwrap().layout.cp > 1,
            "{}",
            r.best().unwrap().layout
        );
    }

    #[test]
    fn cp_degrees_and_modes_searched() {
        let mut p = long_gpt_30b(AttentionKind::Flash);
        let layouts = enumerate(&p);
        let mut degrees: Vec<u64> = layouts.iter().map(|l| l.cp).collect();
        degrees.sort_unstable();
        degrees.dedup();
        assert_eq!(degrees, [1, 2, 4, 8]);
        assert!(layouts
            .iter()
            .all(|l| l.cp > 1 || l.cp_mode == CpMode::Ring));
        assert!(layouts
            .iter()
            .any(|l| l.cp > 1 && l.cp_mode == CpMode::Ulysses));
        // A mode the user fixed is the only one searched.
        p.setup.cp_mode = Some(CpMode::Ulysses);
        let r = search(&p).unwrap();
        assert!(r
            .ranked
            .iter()
            .all(|e| e.layout.cp == 1 || e.layout.cp_mode == CpMode::Ulysses));
    }

    #[test]
    fn a_given_layout_gets_the_better_cp_mode_or_both_reasons() {
        // gpt-30b has 56 heads: at tp = 1 and cp = 8 both modes run, at tp = 2 (28 heads per
        // rank) only ring does.
        let p = long_gpt_30b(AttentionKind::Flash);
        let both = evaluate_layout(&p, &Layout::parse("cp=8,zero=3,mb=1").unwrap()).unwrap();
        let other = p
            .evaluate(&Layout {
                cp_mode: match both.layout.cp_mode {
                    CpMode::Ring => CpMode::Ulysses,
                    CpMode::Ulysses => CpMode::Ring,
                },
                ..both.layout.clone()
            })
            .unwrap();
        assert!(both.throughput.samples_per_s >= other.throughput.samples_per_s);
        let mut small = problem("gpt-30b", "h100", 16, 16);
        let ring = evaluate_layout(&small, &Layout::parse("tp=2,cp=8,zero=3").unwrap()).unwrap();
        assert_eq!(ring.layout.cp_mode, CpMode::Ring);
        small.model = small.model.with_seq_len(2040).unwrap();
        let err = evaluate_layout(&small, &Layout::parse("tp=2,cp=8,zero=3").unwrap())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("ring: sequence length 2040 does not split")
                && err.contains("; ulysses: Ulysses gives each cp rank whole heads"),
            "{err}"
        );
    }

    #[test]
    fn impossible_problem_names_the_closest_miss() {
        // A 1T model on 8 GPUs cannot fit.
        let p = problem("gpt-1t", "h100", 8, 64);
        let err = search_feasible(&p).unwrap_err().to_string();
        assert!(
            err.contains("no feasible layout") && err.contains("needs"),
            "{err}"
        );
    }
}
