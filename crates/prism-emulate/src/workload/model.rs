//! One rank's shard of the GPT model: forward, backward, gradient all-reduce and AdamW.

use super::kernels::{
    gelu, gelu_back, layer_norm, layer_norm_back, matmul, matmul_nt, matmul_tn_acc,
};
use super::mem::Buf;
use super::{Config, Coord, batch, mix};
use crate::comm::{CommError, Communicator, ReduceOp};

/// A parameter with its gradient and AdamW moments.
#[derive(Debug)]
pub struct Param {
    /// Short name with the global layer (`layer3.wq`, `emb`, `wout`).
    pub name: String,
    pub w: Buf,
    pub g: Buf,
    m: Buf,
    v: Buf,
    decay: bool,
}

impl Param {
    fn new(name: String, w: Vec<f32>, decay: bool) -> Param {
        let n = w.len();
        Param {
            name,
            w: Buf::from_vec(w),
            g: Buf::zeros(n),
            m: Buf::zeros(n),
            v: Buf::zeros(n),
            decay,
        }
    }
}

/// How a parameter's full matrix `[rows, cols]` is split over TP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// Replicated on every TP rank.
    None,
    /// TP rank `t` holds columns `[t * cols / tp, (t + 1) * cols / tp)`.
    Columns,
    /// TP rank `t` holds rows `[t * rows / tp, (t + 1) * rows / tp)`.
    Rows,
}

/// Full (unsplit) values of a parameter: uniform with standard deviation `std`, drawn from a
/// stream keyed by the seed and the parameter's name, so every layout holds the same model.
fn init_full(cfg: &Config, name: &str, n: usize, std: f32) -> Vec<f32> {
    let key = name.bytes().fold(mix(cfg.seed), |h, b| mix(h ^ b as u64));
    let a = std * 3f32.sqrt();
    (0..n)
        .map(|i| {
            let u = (mix(key ^ mix(i as u64)) >> 11) as f64 / (1u64 << 53) as f64;
            ((2.0 * u - 1.0) as f32) * a
        })
        .collect()
}

/// The shard of TP rank `t` (of `tp`) of a full `[rows, cols]` matrix.
pub fn shard(
    full: &[f32],
    rows: usize,
    cols: usize,
    split: Split,
    t: usize,
    tp: usize,
) -> Vec<f32> {
    match split {
        Split::None => full.to_vec(),
        Split::Columns => {
            let c = cols / tp;
            (0..rows)
                .flat_map(|r| {
                    full[r * cols + t * c..r * cols + (t + 1) * c]
                        .iter()
                        .copied()
                })
                .collect()
        }
        Split::Rows => {
            let r = rows / tp;
            full[t * r * cols..(t + 1) * r * cols].to_vec()
        }
    }
}

// Indices of a layer's parameters.
const LN1G: usize = 0;
const LN1B: usize = 1;
const WQ: usize = 2;
const WK: usize = 3;
const WV: usize = 4;
const WO: usize = 5;
const LN2G: usize = 6;
const LN2B: usize = 7;
const W1: usize = 8;
const W2: usize = 9;

/// Name, shape `(rows, cols)` given `(hidden, ffn)`, split, and init std of a layer's
/// parameters, in index order.
pub fn layer_params(h: usize, f: usize) -> [(&'static str, usize, usize, Split, f32); 10] {
    [
        ("ln1_g", 1, h, Split::None, 0.0),
        ("ln1_b", 1, h, Split::None, 0.0),
        ("wq", h, h, Split::Columns, 0.2),
        ("wk", h, h, Split::Columns, 0.2),
        ("wv", h, h, Split::Columns, 0.2),
        ("wo", h, h, Split::Rows, 0.1),
        ("ln2_g", 1, h, Split::None, 0.0),
        ("ln2_b", 1, h, Split::None, 0.0),
        ("w1", h, f, Split::Columns, 0.2),
        ("w2", f, h, Split::Rows, 0.1),
    ]
}

/// What a layer's forward keeps for its backward.
#[derive(Debug)]
struct LayerCache {
    x: Buf,
    ln1: (Buf, Buf, Buf),
    q: Buf,
    k: Buf,
    v: Buf,
    p: Buf,
    att: Buf,
    x2: Buf,
    ln2: (Buf, Buf, Buf),
    u: Buf,
    gu: Buf,
}

/// What a micro-batch's forward keeps.
#[derive(Debug)]
struct MbCache {
    toks: Vec<usize>,
    layers: Vec<LayerCache>,
    /// Last stage: input of the final norm, its output and statistics, and the loss gradient
    /// of the logits.
    head: Option<(Buf, (Buf, Buf, Buf), Buf)>,
}

/// One rank's shard of the model.
#[derive(Debug)]
pub struct Model {
    cfg: Config,
    rank: usize,
    coord: Coord,
    /// Per local layer, the parameters in the order of [`layer_params`].
    layers: Vec<Vec<Param>>,
    /// First stage: token and position embeddings.
    emb: Vec<Param>,
    /// Last stage: final norm gain and bias, LM head `[hidden, vocab]`.
    head: Vec<Param>,
    tp_group: Vec<u32>,
    dp_group: Vec<u32>,
    adam_t: i32,
}

impl Model {
    /// The shard of `rank` of the model `cfg` describes (deterministic from `cfg.seed`).
    pub fn new(cfg: &Config, rank: usize) -> Result<Model, String> {
        cfg.validate()?;
        if rank >= cfg.world() {
            return Err(format!("rank {rank} outside a world of {}", cfg.world()));
        }
        let c = cfg.coord(rank);
        let (h, f, tp) = (cfg.hidden, cfg.ffn, cfg.tp);
        let per = cfg.layers / cfg.pp;
        let mut layers = Vec::new();
        for l in 0..per {
            let gl = c.pp * per + l;
            let ps = layer_params(h, f)
                .iter()
                .map(|&(n, rows, cols, split, std)| {
                    let name = format!("layer{gl}.{n}");
                    let full = if std == 0.0 {
                        vec![if n.ends_with("_g") { 1.0 } else { 0.0 }; rows * cols]
                    } else {
                        init_full(cfg, &name, rows * cols, std)
                    };
                    Param::new(
                        name,
                        shard(&full, rows, cols, split, c.tp, tp),
                        split != Split::None,
                    )
                })
                .collect();
            layers.push(ps);
        }
        let mut emb = Vec::new();
        if c.pp == 0 {
            emb.push(Param::new(
                "emb".into(),
                init_full(cfg, "emb", cfg.vocab * h, 0.5),
                true,
            ));
            emb.push(Param::new(
                "pos".into(),
                init_full(cfg, "pos", cfg.seq * h, 0.1),
                false,
            ));
        }
        let mut head = Vec::new();
        if c.pp + 1 == cfg.pp {
            head.push(Param::new("lnf_g".into(), vec![1.0; h], false));
            head.push(Param::new("lnf_b".into(), vec![0.0; h], false));
            head.push(Param::new(
                "wout".into(),
                init_full(cfg, "wout", h * cfg.vocab, 0.2),
                true,
            ));
        }
        Ok(Model {
            cfg: cfg.clone(),
            rank,
            coord: c,
            layers,
            emb,
            head,
            tp_group: cfg.tp_group(rank),
            dp_group: cfg.dp_group(rank),
            adam_t: 0,
        })
    }

    /// The parameters of this rank (embeddings, layers, head), in a fixed order.
    pub fn params(&self) -> impl Iterator<Item = &Param> {
        self.emb
            .iter()
            .chain(self.layers.iter().flatten())
            .chain(self.head.iter())
    }

    /// The parameter named `name`, mutably (tests perturb weights with it).
    pub fn param_mut(&mut self, name: &str) -> Option<&mut Param> {
        self.params_mut().find(|p| p.name == name)
    }

    fn params_mut(&mut self) -> impl Iterator<Item = &mut Param> {
        self.emb
            .iter_mut()
            .chain(self.layers.iter_mut().flatten())
            .chain(self.head.iter_mut())
    }

    /// This rank's coordinates.
    pub fn coord(&self) -> Coord {
        self.coord
    }

    fn tp_all_reduce(&self, comm: &mut Communicator, b: &mut [f32]) -> Result<(), CommError> {
        if self.tp_group.len() > 1 {
            comm.all_reduce(&self.tp_group, b, ReduceOp::Sum)?;
        }
        Ok(())
    }

    fn peer(&self, delta: isize) -> u32 {
        let pp = (self.coord.pp as isize + delta) as usize;
        self.cfg.rank_of(Coord { pp, ..self.coord }) as u32
    }

    /// Forward and backward over this replica's micro-batches of `step` (GPipe), then the
    /// data-parallel gradient all-reduce. Returns this rank's share of the global mean loss
    /// (non-zero on the last stage only; summing it over the DP ranks of one TP index gives the
    /// global batch's mean loss).
    pub fn forward_backward(
        &mut self,
        comm: &mut Communicator,
        step: u64,
    ) -> Result<f64, CommError> {
        let cfg = self.cfg.clone();
        let (s, h) = (cfg.seq, cfg.hidden);
        let first = self.coord.pp == 0;
        let last = self.coord.pp + 1 == cfg.pp;
        for p in self.params_mut() {
            p.g.fill(0.0);
        }
        let scale = 1.0 / (cfg.seq * cfg.micro_batches * cfg.dp) as f32;
        let mut loss = 0.0f64;
        let mut caches = Vec::with_capacity(cfg.micro_batches);
        for m in 0..cfg.micro_batches {
            let gm = self.coord.dp * cfg.micro_batches + m;
            let (toks, targets) = batch(&cfg, step, gm);
            let mut x = if first {
                let (e, pos) = (&self.emb[0].w, &self.emb[1].w);
                let mut x = Buf::zeros(s * h);
                for (i, &t) in toks.iter().enumerate() {
                    for j in 0..h {
                        x[i * h + j] = e[t * h + j] + pos[i * h + j];
                    }
                }
                x
            } else {
                let mut x = Buf::zeros(s * h);
                comm.recv(self.peer(-1), &mut x)?;
                x
            };
            let mut lc = Vec::with_capacity(self.layers.len());
            for l in 0..self.layers.len() {
                let (y, c) = self.layer_forward(comm, l, x)?;
                lc.push(c);
                x = y;
            }
            let head = if last {
                let (l, c) = self.head_forward(&x, &targets, scale);
                loss += l;
                Some((x, c.0, c.1))
            } else {
                comm.send(self.peer(1), &x)?;
                None
            };
            caches.push(MbCache {
                toks,
                layers: lc,
                head,
            });
        }
        for c in caches {
            let mut dy = match c.head {
                Some((x, ln, dlogits)) => self.head_backward(&x, &ln, &dlogits),
                None => {
                    let mut d = Buf::zeros(s * h);
                    comm.recv(self.peer(1), &mut d)?;
                    d
                }
            };
            for (l, lc) in c.layers.into_iter().enumerate().rev() {
                dy = self.layer_backward(comm, l, lc, dy)?;
            }
            if first {
                let (ge, gp) = self.emb.split_at_mut(1);
                for (i, &t) in c.toks.iter().enumerate() {
                    for j in 0..h {
                        ge[0].g[t * h + j] += dy[i * h + j];
                        gp[0].g[i * h + j] += dy[i * h + j];
                    }
                }
            } else {
                comm.send(self.peer(-1), &dy)?;
            }
        }
        if self.dp_group.len() > 1 {
            let n: usize = self.params().map(|p| p.g.len()).sum();
            let mut bucket = Buf::zeros(n);
            let mut o = 0;
            for p in self.params() {
                bucket[o..o + p.g.len()].copy_from_slice(&p.g);
                o += p.g.len();
            }
            let group = self.dp_group.clone();
            comm.all_reduce(&group, &mut bucket, ReduceOp::Sum)?;
            let mut o = 0;
            for p in self.params_mut() {
                let k = p.g.len();
                p.g.copy_from_slice(&bucket[o..o + k]);
                o += k;
            }
        }
        Ok(loss)
    }

    /// One AdamW update of every parameter from its gradient (lr from the config, betas 0.9
    /// and 0.95, eps 1e-8, weight decay 0.01 on matrices).
    pub fn adamw(&mut self) {
        self.adam_t += 1;
        let (b1, b2, eps, wd) = (0.9f32, 0.95f32, 1e-8f32, 0.01f32);
        let lr = self.cfg.lr;
        let c1 = 1.0 - b1.powi(self.adam_t);
        let c2 = 1.0 - b2.powi(self.adam_t);
        for p in self.params_mut() {
            for i in 0..p.w.len() {
                let g = p.g[i];
                p.m[i] = b1 * p.m[i] + (1.0 - b1) * g;
                p.v[i] = b2 * p.v[i] + (1.0 - b2) * g * g;
                let upd = (p.m[i] / c1) / ((p.v[i] / c2).sqrt() + eps);
                let decay = if p.decay { wd * p.w[i] } else { 0.0 };
                p.w[i] -= lr * (upd + decay);
            }
        }
    }

    /// A training step: [`Model::forward_backward`] then [`Model::adamw`].
    pub fn train_step(&mut self, comm: &mut Communicator, step: u64) -> Result<f64, CommError> {
        let loss = self.forward_backward(comm, step)?;
        self.adamw();
        Ok(loss)
    }

    fn layer_forward(
        &self,
        comm: &mut Communicator,
        l: usize,
        x: Buf,
    ) -> Result<(Buf, LayerCache), CommError> {
        let cfg = &self.cfg;
        let (s, h) = (cfg.seq, cfg.hidden);
        let hl = h / cfg.tp;
        let fl = cfg.ffn / cfg.tp;
        let p = &self.layers[l];
        let ln1 = layer_norm(&x, &p[LN1G].w, &p[LN1B].w, s, h);
        let q = matmul(&ln1.0, &p[WQ].w, s, h, hl);
        let k = matmul(&ln1.0, &p[WK].w, s, h, hl);
        let v = matmul(&ln1.0, &p[WV].w, s, h, hl);
        let (att, pr) = self.attention(&q, &k, &v);
        let mut o = matmul(&att, &p[WO].w, s, hl, h);
        self.tp_all_reduce(comm, &mut o)?;
        let mut x2 = x.clone();
        for (a, b) in x2.iter_mut().zip(o.iter()) {
            *a += b;
        }
        drop(o);
        let ln2 = layer_norm(&x2, &p[LN2G].w, &p[LN2B].w, s, h);
        let u = matmul(&ln2.0, &p[W1].w, s, h, fl);
        let gu = gelu(&u);
        let mut mo = matmul(&gu, &p[W2].w, s, fl, h);
        self.tp_all_reduce(comm, &mut mo)?;
        let mut y = x2.clone();
        for (a, b) in y.iter_mut().zip(mo.iter()) {
            *a += b;
        }
        Ok((
            y,
            LayerCache {
                x,
                ln1,
                q,
                k,
                v,
                p: pr,
                att,
                x2,
                ln2,
                u,
                gu,
            },
        ))
    }

    fn layer_backward(
        &mut self,
        comm: &mut Communicator,
        l: usize,
        c: LayerCache,
        dy: Buf,
    ) -> Result<Buf, CommError> {
        let cfg = self.cfg.clone();
        let (s, h) = (cfg.seq, cfg.hidden);
        let hl = h / cfg.tp;
        let fl = cfg.ffn / cfg.tp;
        // MLP.
        let dgu = matmul_nt(&dy, &self.layers[l][W2].w, s, h, fl);
        matmul_tn_acc(&mut self.layers[l][W2].g, &c.gu, &dy, s, fl, h);
        let du = gelu_back(&dgu, &c.u);
        drop(dgu);
        matmul_tn_acc(&mut self.layers[l][W1].g, &c.ln2.0, &du, s, h, fl);
        let mut dh2 = matmul_nt(&du, &self.layers[l][W1].w, s, fl, h);
        drop(du);
        self.tp_all_reduce(comm, &mut dh2)?;
        let p = &mut self.layers[l];
        let (g2, b2) = split2(p, LN2G, LN2B);
        let mut dx2 = layer_norm_back(
            &dh2, &c.x2, &c.ln2.1, &c.ln2.2, &g2.w, &mut g2.g, &mut b2.g, s, h,
        );
        drop(dh2);
        for (a, b) in dx2.iter_mut().zip(dy.iter()) {
            *a += b;
        }
        drop(dy);
        // Attention.
        let datt = matmul_nt(&dx2, &p[WO].w, s, h, hl);
        matmul_tn_acc(&mut p[WO].g, &c.att, &dx2, s, hl, h);
        let (dq, dk, dv) = self.attention_back(&c.q, &c.k, &c.v, &c.p, &datt);
        drop(datt);
        let p = &mut self.layers[l];
        matmul_tn_acc(&mut p[WQ].g, &c.ln1.0, &dq, s, h, hl);
        matmul_tn_acc(&mut p[WK].g, &c.ln1.0, &dk, s, h, hl);
        matmul_tn_acc(&mut p[WV].g, &c.ln1.0, &dv, s, h, hl);
        let mut dh1 = matmul_nt(&dq, &p[WQ].w, s, hl, h);
        for (w, d) in [(WK, &dk), (WV, &dv)] {
            let t = matmul_nt(d, &p[w].w, s, hl, h);
            for (a, b) in dh1.iter_mut().zip(t.iter()) {
                *a += b;
            }
        }
        drop((dq, dk, dv));
        self.tp_all_reduce(comm, &mut dh1)?;
        let p = &mut self.layers[l];
        let (g1, b1) = split2(p, LN1G, LN1B);
        let mut dx = layer_norm_back(
            &dh1, &c.x, &c.ln1.1, &c.ln1.2, &g1.w, &mut g1.g, &mut b1.g, s, h,
        );
        for (a, b) in dx.iter_mut().zip(dx2.iter()) {
            *a += b;
        }
        Ok(dx)
    }

    /// Causal attention over this rank's heads: returns the output `[seq, hidden / tp]` and
    /// the probabilities `[heads / tp, seq, seq]`.
    fn attention(&self, q: &[f32], k: &[f32], v: &[f32]) -> (Buf, Buf) {
        let cfg = &self.cfg;
        let s = cfg.seq;
        let d = cfg.hidden / cfg.heads;
        let al = cfg.heads / cfg.tp;
        let w = al * d;
        let scale = 1.0 / (d as f32).sqrt();
        let mut out = Buf::zeros(s * w);
        let mut pr = Buf::zeros(al * s * s);
        for hd in 0..al {
            for i in 0..s {
                let row = &mut pr[(hd * s + i) * s..(hd * s + i + 1) * s];
                let mut mx = f32::NEG_INFINITY;
                for (j, r) in row.iter_mut().enumerate().take(i + 1) {
                    let mut dot = 0.0f32;
                    for t in 0..d {
                        dot += q[i * w + hd * d + t] * k[j * w + hd * d + t];
                    }
                    *r = dot * scale;
                    mx = mx.max(*r);
                }
                let mut sum = 0.0f32;
                for r in row.iter_mut().take(i + 1) {
                    *r = (*r - mx).exp();
                    sum += *r;
                }
                for r in row.iter_mut().take(i + 1) {
                    *r /= sum;
                }
                for (j, &pj) in row.iter().enumerate().take(i + 1) {
                    for t in 0..d {
                        out[i * w + hd * d + t] += pj * v[j * w + hd * d + t];
                    }
                }
            }
        }
        (out, pr)
    }

    fn attention_back(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        pr: &[f32],
        dout: &[f32],
    ) -> (Buf, Buf, Buf) {
        let cfg = &self.cfg;
        let s = cfg.seq;
        let d = cfg.hidden / cfg.heads;
        let al = cfg.heads / cfg.tp;
        let w = al * d;
        let scale = 1.0 / (d as f32).sqrt();
        let mut dq = Buf::zeros(s * w);
        let mut dk = Buf::zeros(s * w);
        let mut dv = Buf::zeros(s * w);
        let mut dp = Buf::zeros(s);
        for hd in 0..al {
            for i in 0..s {
                let row = &pr[(hd * s + i) * s..(hd * s + i + 1) * s];
                let mut dot = 0.0f32;
                for j in 0..=i {
                    let mut g = 0.0f32;
                    for t in 0..d {
                        g += dout[i * w + hd * d + t] * v[j * w + hd * d + t];
                        dv[j * w + hd * d + t] += row[j] * dout[i * w + hd * d + t];
                    }
                    dp[j] = g;
                    dot += g * row[j];
                }
                for j in 0..=i {
                    let ds = row[j] * (dp[j] - dot) * scale;
                    for t in 0..d {
                        dq[i * w + hd * d + t] += ds * k[j * w + hd * d + t];
                        dk[j * w + hd * d + t] += ds * q[i * w + hd * d + t];
                    }
                }
            }
        }
        (dq, dk, dv)
    }

    /// Final norm, logits, cross-entropy: returns the scaled loss, and (norm cache, gradient of
    /// the logits).
    fn head_forward(
        &self,
        x: &[f32],
        targets: &[usize],
        scale: f32,
    ) -> (f64, ((Buf, Buf, Buf), Buf)) {
        let cfg = &self.cfg;
        let (s, h, vcb) = (cfg.seq, cfg.hidden, cfg.vocab);
        let ln = layer_norm(x, &self.head[0].w, &self.head[1].w, s, h);
        let mut lg = matmul(&ln.0, &self.head[2].w, s, h, vcb);
        let mut loss = 0.0f64;
        for (i, &t) in targets.iter().enumerate() {
            let row = &mut lg[i * vcb..(i + 1) * vcb];
            let mx = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0f32;
            for r in row.iter_mut() {
                *r = (*r - mx).exp();
                sum += *r;
            }
            loss -= ((row[t] / sum).ln() * scale) as f64;
            for r in row.iter_mut() {
                *r = *r / sum * scale;
            }
            row[t] -= scale;
        }
        (loss, (ln, lg))
    }

    fn head_backward(&mut self, x: &[f32], ln: &(Buf, Buf, Buf), dlogits: &[f32]) -> Buf {
        let cfg = &self.cfg;
        let (s, h, vcb) = (cfg.seq, cfg.hidden, cfg.vocab);
        matmul_tn_acc(&mut self.head[2].g, &ln.0, dlogits, s, h, vcb);
        let dn = matmul_nt(dlogits, &self.head[2].w, s, vcb, h);
        let (g, b) = split2(&mut self.head, 0, 1);
        layer_norm_back(&dn, x, &ln.1, &ln.2, &g.w, &mut g.g, &mut b.g, s, h)
    }

    /// The rank this model belongs to.
    pub fn rank(&self) -> usize {
        self.rank
    }
}

/// Two distinct parameters of `p` mutably (`i < j`).
fn split2(p: &mut [Param], i: usize, j: usize) -> (&mut Param, &mut Param) {
    let (a, b) = p.split_at_mut(j);
    (&mut a[i], &mut b[0])
}
