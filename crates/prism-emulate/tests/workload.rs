//! The reference workload: a parallel run over the TCP mesh computes the single-process step
//! (loss and every gradient shard), training lowers the loss, runs repeat bit for bit, and the
//! peak of the memory ledger does not depend on the backend.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::time::Duration;

use prism_emulate::comm::Communicator;
use prism_emulate::workload::model::{Split, layer_params, shard};
use prism_emulate::workload::{Config, Model, mem};

struct RankOut {
    rank: usize,
    loss: f64,
    grads: Vec<(String, Vec<f32>)>,
    peak: u64,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn run_rank(cfg: &Config, rank: usize, mut comm: Communicator) -> RankOut {
    mem::reset_peak();
    let base = mem::current_bytes();
    let mut m = Model::new(cfg, rank).unwrap();
    let loss = m.forward_backward(&mut comm, 0).unwrap();
    let grads = m.params().map(|p| (p.name.clone(), p.g.to_vec())).collect();
    let peak = mem::peak_bytes() - base;
    comm.finish(peak).unwrap();
    RankOut {
        rank,
        loss,
        grads,
        peak,
    }
}

fn run_tcp(cfg: &Config) -> Vec<RankOut> {
    let addr = format!("127.0.0.1:{}", free_port());
    let world = cfg.world();
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let addr = addr.clone();
                s.spawn(move || {
                    let c =
                        Communicator::tcp(r as u32, world as u32, &addr, Duration::from_secs(30))
                            .unwrap();
                    run_rank(cfg, r, c)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn split_of(name: &str, cfg: &Config) -> (usize, usize, Split) {
    let (h, f) = (cfg.hidden, cfg.ffn);
    if let Some((_, n)) = name.split_once('.') {
        let p = layer_params(h, f);
        let e = p.iter().find(|e| e.0 == n).unwrap();
        (e.1, e.2, e.3)
    } else {
        (0, 0, Split::None)
    }
}

fn check_against_reference(layout: &str) {
    let par = Config::tiny().with_layout(layout).unwrap();
    let mut single = Config::tiny();
    single.micro_batches = par.micro_batches * par.dp;
    let reference = run_rank(&single, 0, Communicator::local(0, 1));
    let reference_grads: BTreeMap<_, _> = reference.grads.iter().cloned().collect();
    let outs = run_tcp(&par);
    let mut loss = 0.0;
    for o in &outs {
        let c = par.coord(o.rank);
        if c.pp + 1 == par.pp && c.tp == 0 {
            loss += o.loss;
        }
        for (name, g) in &o.grads {
            let full = &reference_grads[name];
            let (rows, cols, split) = split_of(name, &par);
            let want = shard(full, rows, cols, split, c.tp, par.tp);
            assert_eq!(g.len(), want.len(), "{layout}: rank {} {name}", o.rank);
            let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
            for (i, (a, b)) in g.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-4 * scale,
                    "{layout}: rank {} {name}[{i}] = {a}, single process {b}",
                    o.rank
                );
            }
        }
    }
    assert!(
        (loss - reference.loss).abs() <= 1e-5 * reference.loss.abs(),
        "{layout}: loss {loss} vs single process {}",
        reference.loss
    );
}

#[test]
fn tp2_pp2_dp2_equals_one_process() {
    check_against_reference("2,2,2");
}

#[test]
fn tp2_alone_pp2_alone_dp2_alone_equal_one_process() {
    for l in ["2,1,1", "1,2,1", "1,1,2", "4,1,1"] {
        check_against_reference(l);
    }
}

#[test]
fn tcp_runs_repeat_bit_for_bit_and_peak_is_backend_independent() {
    let cfg = Config::tiny().with_layout("2,2,1").unwrap();
    let a = run_tcp(&cfg);
    let b = run_tcp(&cfg);
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.loss.to_bits(), y.loss.to_bits());
        for ((_, g), (_, h)) in x.grads.iter().zip(&y.grads) {
            assert!(g.iter().zip(h).all(|(p, q)| p.to_bits() == q.to_bits()));
        }
        assert_eq!(x.peak, y.peak);
    }
    // Each rank alone on the recording backend: same ledger peak.
    for x in &a {
        let r = x.rank;
        let local = std::thread::scope(|s| {
            s.spawn(|| run_rank(&cfg, r, Communicator::local(r as u32, 4)))
                .join()
                .unwrap()
        });
        assert_eq!(local.peak, x.peak, "rank {r}");
        assert!(local.peak > 0);
    }
    // The first stage holds the embeddings, the last the head: their peaks differ.
    assert_ne!(a[0].peak, a[2].peak);
}

#[test]
fn training_lowers_the_loss() {
    let cfg = Config::tiny();
    let mut m = Model::new(&cfg, 0).unwrap();
    let mut c = Communicator::local(0, 1);
    let losses: Vec<f64> = (0..30).map(|s| m.train_step(&mut c, s).unwrap()).collect();
    let first: f64 = losses[..3].iter().sum();
    let lastv: f64 = losses[27..].iter().sum();
    assert!(lastv < 0.8 * first, "loss did not fall: {:?}", losses);
    // Initial loss near ln(vocab) for a near-uniform prediction.
    assert!(
        (losses[0] - (cfg.vocab as f64).ln()).abs() < 1.0,
        "{}",
        losses[0]
    );
}

#[test]
fn bad_configs_are_refused_by_key() {
    let e = Config::tiny()
        .with_layout("3,1,1")
        .unwrap()
        .validate()
        .unwrap_err();
    assert!(e.contains("heads 4 is not a multiple of tp 3"), "{e}");
    let e = Config::tiny()
        .with_layout("1,3,1")
        .unwrap()
        .validate()
        .unwrap_err();
    assert!(e.contains("layers 2 is not a multiple of pp 3"), "{e}");
    assert!(Config::tiny().with_layout("2,x,1").is_err());
    assert!(Config::tiny().with_layout("2,0,1").is_err());
    assert!(Model::new(&Config::tiny(), 1).is_err());
}

#[test]
fn gradients_match_finite_differences() {
    let mut cfg = Config::tiny();
    cfg.layers = 1;
    let mut m = Model::new(&cfg, 0).unwrap();
    let mut c = Communicator::local(0, 1);
    m.forward_backward(&mut c, 3).unwrap();
    let names = [
        "emb",
        "pos",
        "layer0.wq",
        "layer0.wk",
        "layer0.wv",
        "layer0.wo",
        "layer0.ln1_g",
        "layer0.w1",
        "layer0.w2",
        "layer0.ln2_b",
        "lnf_g",
        "wout",
    ];
    for name in names {
        let g = m.param_mut(name).unwrap().g.to_vec();
        // The three largest gradient entries.
        let mut idx: Vec<usize> = (0..g.len()).collect();
        idx.sort_by(|&a, &b| g[b].abs().total_cmp(&g[a].abs()));
        for &i in &idx[..3] {
            let eps = 1e-2f32;
            let w0 = m.param_mut(name).unwrap().w[i];
            m.param_mut(name).unwrap().w[i] = w0 + eps;
            let lp = m.forward_backward(&mut c, 3).unwrap();
            m.param_mut(name).unwrap().w[i] = w0 - eps;
            let lm = m.forward_backward(&mut c, 3).unwrap();
            m.param_mut(name).unwrap().w[i] = w0;
            let fd = (lp - lm) / (2.0 * eps as f64);
            let an = g[i] as f64;
            assert!(
                (fd - an).abs() <= 0.05 * an.abs() + 2e-4,
                "{name}[{i}]: backprop {an}, finite difference {fd}"
            );
        }
    }
}
