//! The reference workload: a real GPT-style training step on CPU in plain Rust, one process
//! (or thread) per rank, communicating through a [`Communicator`](crate::comm::Communicator)
//! (`docs/emulate.md`, "Reference workload").
//!
//! Model: token + position embedding, `layers` pre-LN transformer layers (causal multi-head
//! attention, GELU MLP), final layer norm, LM head, softmax cross-entropy. Parallelism as in
//! Megatron-LM:
//! - TP: Q, K, V and the first MLP matrix are column-parallel (a rank holds `heads / tp` heads
//!   and `ffn / tp` columns), the attention output and second MLP matrices row-parallel; one
//!   all-reduce after each row-parallel matrix in the forward pass and one on the input
//!   gradient of each column-parallel block in the backward pass. Embeddings, layer norms and
//!   the LM head are replicated across TP.
//! - PP: `layers / pp` consecutive layers per stage; GPipe over `micro_batches` micro-batches
//!   (all forwards, then all backwards), activations and their gradients sent to the
//!   same-TP-index rank of the neighbouring stage.
//! - DP: each replica takes `micro_batches` of the global batch; one all-reduce (sum) of every
//!   gradient in one bucket, then AdamW.
//!
//! Rank layout (Megatron's): `rank = tp_idx + tp * (dp_idx + dp * pp_idx)`.
//! Calls on groups of one rank are skipped (as Megatron skips them).

pub mod kernels;
pub mod mem;
pub mod model;

pub use model::Model;

/// The model and parallel layout of a run.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub vocab: usize,
    pub hidden: usize,
    pub heads: usize,
    pub ffn: usize,
    pub layers: usize,
    /// Tokens per micro-batch.
    pub seq: usize,
    /// Micro-batches per data-parallel replica per step.
    pub micro_batches: usize,
    pub lr: f32,
    pub seed: u64,
    pub tp: usize,
    pub pp: usize,
    pub dp: usize,
}

impl Config {
    /// A small model for tests (milliseconds per step).
    pub fn tiny() -> Config {
        Config {
            vocab: 32,
            hidden: 16,
            heads: 4,
            ffn: 32,
            layers: 2,
            seq: 8,
            micro_batches: 2,
            lr: 1e-2,
            seed: 7,
            tp: 1,
            pp: 1,
            dp: 1,
        }
    }

    /// The default model of the worker and of validation (about 0.1 s of CPU per rank and step
    /// at tp 2, pp 2, dp 2).
    pub fn reference() -> Config {
        Config {
            vocab: 512,
            hidden: 128,
            heads: 8,
            ffn: 512,
            layers: 4,
            seq: 64,
            micro_batches: 4,
            lr: 1e-3,
            seed: 1,
            tp: 1,
            pp: 1,
            dp: 1,
        }
    }

    /// Sets `tp,pp,dp` from text such as `2,2,2`.
    pub fn with_layout(mut self, layout: &str) -> Result<Config, String> {
        let parts: Vec<&str> = layout.split(',').map(str::trim).collect();
        let bad = || format!("layout {layout:?}: expected tp,pp,dp (three positive integers)");
        if parts.len() != 3 {
            return Err(bad());
        }
        let v: Vec<usize> = parts
            .iter()
            .map(|p| p.parse::<usize>().ok().filter(|&x| x > 0))
            .collect::<Option<_>>()
            .ok_or_else(bad)?;
        self.tp = v[0];
        self.pp = v[1];
        self.dp = v[2];
        Ok(self)
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.tp * self.pp * self.dp
    }

    /// Checks the divisibility rules; the message names the key.
    pub fn validate(&self) -> Result<(), String> {
        let pos = [
            ("vocab", self.vocab),
            ("hidden", self.hidden),
            ("heads", self.heads),
            ("ffn", self.ffn),
            ("layers", self.layers),
            ("seq", self.seq),
            ("micro_batches", self.micro_batches),
            ("tp", self.tp),
            ("pp", self.pp),
            ("dp", self.dp),
        ];
        for (k, v) in pos {
            if v == 0 {
                return Err(format!("{k} must be positive"));
            }
        }
        if !self.hidden.is_multiple_of(self.heads) {
            return Err(format!(
                "hidden {} is not a multiple of heads {}",
                self.hidden, self.heads
            ));
        }
        if !self.heads.is_multiple_of(self.tp) {
            return Err(format!(
                "heads {} is not a multiple of tp {}",
                self.heads, self.tp
            ));
        }
        if !self.ffn.is_multiple_of(self.tp) {
            return Err(format!(
                "ffn {} is not a multiple of tp {}",
                self.ffn, self.tp
            ));
        }
        if !self.layers.is_multiple_of(self.pp) {
            return Err(format!(
                "layers {} is not a multiple of pp {}",
                self.layers, self.pp
            ));
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(format!("lr {} must be positive and finite", self.lr));
        }
        Ok(())
    }

    /// The coordinates of `rank`.
    pub fn coord(&self, rank: usize) -> Coord {
        Coord {
            tp: rank % self.tp,
            dp: (rank / self.tp) % self.dp,
            pp: rank / (self.tp * self.dp),
        }
    }

    /// The rank at `c`.
    pub fn rank_of(&self, c: Coord) -> usize {
        c.tp + self.tp * (c.dp + self.dp * c.pp)
    }

    /// The TP group of `rank` (global ranks, group order).
    pub fn tp_group(&self, rank: usize) -> Vec<u32> {
        let c = self.coord(rank);
        (0..self.tp)
            .map(|t| self.rank_of(Coord { tp: t, ..c }) as u32)
            .collect()
    }

    /// The DP group of `rank`.
    pub fn dp_group(&self, rank: usize) -> Vec<u32> {
        let c = self.coord(rank);
        (0..self.dp)
            .map(|d| self.rank_of(Coord { dp: d, ..c }) as u32)
            .collect()
    }
}

/// A rank's position in the layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Coord {
    pub tp: usize,
    pub dp: usize,
    pub pp: usize,
}

/// A deterministic 64-bit mix (splitmix64) of `x`.
pub fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The tokens and targets of global micro-batch `gm` of `step`: targets are a fixed function
/// of the token, so the loss can fall.
pub fn batch(cfg: &Config, step: u64, gm: usize) -> (Vec<usize>, Vec<usize>) {
    let toks: Vec<usize> = (0..cfg.seq)
        .map(|s| {
            (mix(cfg.seed ^ mix(step.wrapping_mul(1_000_003) ^ mix(gm as u64 * 7919 + s as u64)))
                % cfg.vocab as u64) as usize
        })
        .collect();
    let targets = toks.iter().map(|t| (t * 7 + 3) % cfg.vocab).collect();
    (toks, targets)
}
