//! Training workloads with variable sequence lengths: documents of long-tailed (log-normal)
//! length packed greedily into micro-batches of a token capacity, as packed-sequence training
//! does. The attention cost of a micro-batch follows the sum of its squared lengths, so two
//! micro-batches of the same token count can differ several-fold in attention work.

use prism_core::hetero::MicroBatch;
use rand::RngExt;
use rand_distr::{Distribution, LogNormal};
use rand_xoshiro::Xoshiro256PlusPlus;

/// A long-tailed document-length distribution and the packing capacity.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Workload {
    /// Median document length, tokens.
    pub median_len: f64,
    /// Log-normal shape (sigma of ln length); 0 gives fixed-length documents.
    pub sigma: f64,
    /// Tokens per micro-batch (packing capacity; documents longer than it are cut to it).
    pub capacity: u64,
}

impl Workload {
    /// Draws one document length in `[1, capacity]`.
    pub fn draw_len(&self, rng: &mut Xoshiro256PlusPlus) -> u64 {
        if self.sigma <= 0.0 {
            return (self.median_len.round() as u64).clamp(1, self.capacity);
        }
        let d = LogNormal::new(self.median_len.ln(), self.sigma).expect("sigma > 0");
        (d.sample(rng).round() as u64).clamp(1, self.capacity)
    }

    /// Packs `count` micro-batches: documents are added while they fit; a document that does
    /// not fit starts the next micro-batch (greedy first-fit in arrival order, as data loaders
    /// pack).
    pub fn micro_batches(&self, count: usize, rng: &mut Xoshiro256PlusPlus) -> Vec<MicroBatch> {
        let mut out = Vec::with_capacity(count);
        let mut carry: Option<u64> = None;
        while out.len() < count {
            let mut lens = Vec::new();
            let mut used = 0u64;
            loop {
                let l = carry.take().unwrap_or_else(|| self.draw_len(rng));
                if used + l > self.capacity && !lens.is_empty() {
                    carry = Some(l);
                    break;
                }
                used += l;
                lens.push(l);
                if used == self.capacity {
                    break;
                }
            }
            out.push(MicroBatch::packed(&lens));
        }
        out
    }

    /// The expected micro-batch (mean tokens and mean sum of squared lengths over `n` draws
    /// from the stream of `seed`), used to plan.
    pub fn mean_micro_batch(&self, seed: u64, n: usize) -> MicroBatch {
        let mut rng = prism_predict::stats::stream_rng(seed, &[0x6D65_616E]);
        let mbs = self.micro_batches(n.max(1), &mut rng);
        let k = mbs.len() as u64;
        MicroBatch {
            tokens: mbs.iter().map(|m| m.tokens).sum::<u64>() / k,
            sum_sq_len: mbs.iter().map(|m| m.sum_sq_len).sum::<u64>() / k,
        }
    }
}

/// A uniform draw in `[lo, hi)`.
pub fn uniform(rng: &mut Xoshiro256PlusPlus, lo: f64, hi: f64) -> f64 {
    lo + (hi - lo) * rng.random::<f64>()
}

#[cfg(test)]
mod tests {
    use super::*;
    use prism_predict::stats::stream_rng;

    #[test]
    fn packing_respects_capacity_and_is_long_tailed() {
        let w = Workload {
            median_len: 800.0,
            sigma: 1.2,
            capacity: 8192,
        };
        let mut rng = stream_rng(1, &[]);
        let mbs = w.micro_batches(500, &mut rng);
        assert_eq!(mbs.len(), 500);
        for m in &mbs {
            assert!(m.tokens <= 8192 && m.tokens > 0);
            // sum of squares lies between tokens (all length 1) and tokens^2 (one document).
            assert!(m.sum_sq_len >= m.tokens && m.sum_sq_len <= m.tokens * m.tokens);
        }
        let sq: Vec<f64> = mbs.iter().map(|m| m.sum_sq_len as f64).collect();
        let mean = sq.iter().sum::<f64>() / sq.len() as f64;
        let max = sq.iter().cloned().fold(0.0, f64::max);
        let min = sq.iter().cloned().fold(f64::INFINITY, f64::min);
        assert!(
            max > 2.0 * mean && max > 10.0 * min,
            "long tail: {min} {mean} {max}"
        );
        // Deterministic per seed.
        let again = w.micro_batches(500, &mut stream_rng(1, &[]));
        assert_eq!(mbs, again);
    }
}
