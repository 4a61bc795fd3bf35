//! Tests of the job file's `[variability]` section: every key parsed into
//! `prism_predict::variability::Variability` (plus `variability_seed` and `dist_table` of
//! `LoadedJob`), `--set` overrides, and bad input (each error names the dotted key and the rule).

use std::path::PathBuf;

use prism_io::jobfile::{JobFileError, LoadedJob, default_job, load_job_file, load_job_str};
use prism_predict::variability::{
    CommRegime, Dist, FailSlow, Failures, GpuSpeed, KernelJitter, Variability,
};

/// A small valid job: Llama 3 8B on 4 DGX H100 nodes (8 GPUs per node).
const SMALL: &str = r#"
name = "small"

[model]
preset = "llama3-8b"

[cluster]
preset = "dgx-h100"
nodes = 4

[parallel]
tp = 4
pp = 2

[training]
global_batch = 64
"#;

/// Every key of `[variability]` (except `distributions`, which needs a file).
const FULL: &str = r#"
[variability]
seed = 1
gpu_speed = { dist = "normal", mean = 1.0, std = 0.03 }
gpu_outlier_fraction = 0.01
gpu_outlier_slowdown = 1.2
comm_regime = { dist = "lognormal", mu = 0.0, sigma = 0.1 }

[variability.kernel_jitter]
gemm = { dist = "lognormal", mu = 0.0, sigma = 0.02 }
attention = { dist = "gamma", shape = 400.0, scale = 0.0025 }
norm = { dist = "constant", value = 1.05 }
softmax = 1.01
elementwise = { dist = "empirical", values = [0.98, 1.0, 1.03, 1] }
embedding = { dist = "exponential", mean = 1.0 }
loss = { dist = "normal", mean = 1.0, std = 0.0 }
router = { dist = "normal", mean = 1.0, std = 0.01 }
optimizer = { dist = "normal", mean = 1.0, std = 0.01 }
framework = { dist = "lognormal", mu = 0.0, sigma = 0.2 }
all = { dist = "lognormal", mu = 0.0, sigma = 0.01 }

[variability.fail_slow]
rate_per_gpu_hour = 1e-5
duration_s = { dist = "exponential", mean = 3600 }
slowdown = 2.0

[variability.failures]
rate_per_gpu_hour = 1.97e-5
checkpoint_interval_s = 3600
checkpoint_write_s = 60
restart_s = 600
"#;

fn sets(s: &[&str]) -> Vec<String> {
    s.iter().map(|x| x.to_string()).collect()
}

fn with(var: &str) -> String {
    format!("{SMALL}\n{var}")
}

fn load(var: &str, overrides: &[&str]) -> Result<LoadedJob, JobFileError> {
    load_job_str(&with(var), "test.toml", None, &sets(overrides))
}

fn ok(var: &str, overrides: &[&str]) -> LoadedJob {
    match load(var, overrides) {
        Ok(j) => j,
        Err(e) => panic!("expected the job to load, got: {e}"),
    }
}

/// Loads and expects an error on `key` whose message contains `key` and every part of `rule`.
fn fails(var: &str, overrides: &[&str], key: &str, rule: &[&str]) -> JobFileError {
    let e = match load(var, overrides) {
        Ok(j) => panic!(
            "expected an error on `{key}`, got a valid job: {:?}",
            j.variability
        ),
        Err(e) => e,
    };
    let msg = e.to_string();
    assert_eq!(e.key.as_deref(), Some(key), "wrong key in: {msg}");
    assert!(msg.contains(key), "message lacks key `{key}`: {msg}");
    for part in rule {
        assert!(msg.contains(part), "message lacks `{part}`: {msg}");
    }
    assert!(msg.starts_with("test.toml"), "no origin: {msg}");
    e
}

/// The line of the first occurrence of `needle` in the job text (1-based).
fn line_of(var: &str, needle: &str) -> usize {
    let text = with(var);
    let at = text.find(needle).expect("needle in text");
    text[..at].matches('\n').count() + 1
}

fn full_expected() -> Variability {
    let ln = |sigma| Dist::LogNormal { mu: 0.0, sigma };
    let normal = |std| Dist::Normal { mean: 1.0, std };
    let kj = |class: &str, factor| KernelJitter {
        class: class.to_string(),
        factor,
    };
    Variability {
        gpu_speed: Some(GpuSpeed {
            factor: normal(0.03),
            outlier_fraction: 0.01,
            outlier_slowdown: 1.2,
        }),
        // In the order of the op-class list: all, gemm, attention, norm, softmax, elementwise,
        // embedding, loss, router, optimizer, framework.
        kernel_jitter: vec![
            kj("all", ln(0.01)),
            kj("gemm", ln(0.02)),
            kj(
                "attention",
                Dist::Gamma {
                    shape: 400.0,
                    scale: 0.0025,
                },
            ),
            kj("norm", Dist::Constant(1.05)),
            kj("softmax", Dist::Constant(1.01)),
            kj("elementwise", Dist::Empirical(vec![0.98, 1.0, 1.03, 1.0])),
            kj("embedding", Dist::Exponential { mean: 1.0 }),
            kj("loss", normal(0.0)),
            kj("router", normal(0.01)),
            kj("optimizer", normal(0.01)),
            kj("framework", ln(0.2)),
        ],
        op_jitter: Vec::new(),
        comm_regime: Some(CommRegime { factor: ln(0.1) }),
        fail_slow: Some(FailSlow {
            rate_per_gpu_hour: 1e-5,
            duration_s: Dist::Exponential { mean: 3600.0 },
            slowdown: 2.0,
        }),
        failures: Some(Failures {
            rate_per_gpu_hour: 1.97e-5,
            checkpoint_interval_s: 3600.0,
            checkpoint_write_s: 60.0,
            restart_s: 600.0,
        }),
    }
}

// ---------------------------------------------------------------------------------------------
// Good input
// ---------------------------------------------------------------------------------------------

#[test]
fn absent_section_is_deterministic() {
    let j = ok("", &[]);
    assert_eq!(j.variability, Variability::default());
    assert_eq!(j.variability_seed, None);
    assert_eq!(j.dist_table, None);
    let d = default_job(&[]).unwrap();
    assert_eq!(d.variability, Variability::default());
    // An empty section is the same.
    assert_eq!(
        ok("[variability]\n", &[]).variability,
        Variability::default()
    );
}

#[test]
fn every_key_parses() {
    let j = ok(FULL, &[]);
    assert_eq!(j.variability, full_expected());
    assert_eq!(j.variability_seed, Some(1));
    assert_eq!(j.dist_table, None);
}

#[test]
fn inline_and_dotted_forms_are_the_same() {
    // Top-level keys come before the first section header, so the inline table goes first.
    let inline = r#"
variability = { seed = 1, gpu_speed = { dist = "normal", mean = 1.0, std = 0.03 }, failures = { rate_per_gpu_hour = 1.97e-5, checkpoint_interval_s = 3600, checkpoint_write_s = 60, restart_s = 600 } }
"#;
    let dotted = r#"
[variability]
seed = 1
gpu_speed.dist = "normal"
gpu_speed.mean = 1.0
gpu_speed.std = 0.03
failures.rate_per_gpu_hour = 1.97e-5
failures.checkpoint_interval_s = 3600
failures.checkpoint_write_s = 60
failures.restart_s = 600
"#;
    let a = load_job_str(&format!("{inline}{SMALL}"), "test.toml", None, &[]).unwrap();
    let b = ok(dotted, &[]);
    assert_eq!(a.variability, b.variability);
    let full = full_expected();
    assert_eq!(a.variability.failures, full.failures);
    assert_eq!(
        a.variability.gpu_speed,
        Some(GpuSpeed {
            factor: Dist::Normal {
                mean: 1.0,
                std: 0.03
            },
            outlier_fraction: 0.0,
            outlier_slowdown: 1.0,
        })
    );
}

#[test]
fn defaults_and_conversions() {
    // Outliers without a typical-GPU distribution: typical GPUs are nominal.
    let j = ok(
        "[variability]\ngpu_outlier_fraction = 0.05\ngpu_outlier_slowdown = 1.5\n",
        &[],
    );
    assert_eq!(
        j.variability.gpu_speed,
        Some(GpuSpeed {
            factor: Dist::Constant(1.0),
            outlier_fraction: 0.05,
            outlier_slowdown: 1.5,
        })
    );
    // A failure rate per node-day is converted with the cluster's 8 GPUs per node; writes and
    // restarts default to 0.
    let j = ok(
        "[variability.failures]\nrate_per_node_day = 0.0065\ncheckpoint_interval_s = 1800\n",
        &[],
    );
    let f = j.variability.failures.unwrap();
    assert!((f.rate_per_gpu_hour - 0.0065 / (24.0 * 8.0)).abs() < 1e-18);
    assert_eq!((f.checkpoint_write_s, f.restart_s), (0.0, 0.0));
    // A number is a constant distribution; a dist name is case-insensitive.
    let j = ok(
        "[variability.fail_slow]\nrate_per_gpu_hour = 0\nduration_s = 600\nslowdown = 1\n\
         [variability]\ncomm_regime = { dist = \"LogNormal\", mu = -0.01, sigma = 0.1 }\n",
        &[],
    );
    assert_eq!(
        j.variability.fail_slow.unwrap().duration_s,
        Dist::Constant(600.0)
    );
    assert_eq!(
        j.variability.comm_regime.unwrap().factor,
        Dist::LogNormal {
            mu: -0.01,
            sigma: 0.1
        }
    );
    // The largest seed.
    let j = ok("[variability]\nseed = 18446744073709551615\n", &[]);
    assert_eq!(j.variability_seed, Some(u64::MAX));
}

#[test]
fn distributions_table_is_resolved_against_the_job_file() {
    let dir = std::env::temp_dir().join(format!("prism-variability-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("fitted.csv"), "class,dist\n").unwrap();
    let job = dir.join("job.toml");
    std::fs::write(
        &job,
        with("[variability.distributions]\ntable = \"fitted.csv\"\n"),
    )
    .unwrap();
    let j = load_job_file(&job, &[]).unwrap();
    assert_eq!(j.dist_table, Some(dir.join("fitted.csv")));
    // A missing table is an error naming the key.
    std::fs::write(
        &job,
        with("[variability.distributions]\ntable = \"nope.csv\"\n"),
    )
    .unwrap();
    let e = load_job_file(&job, &[]).unwrap_err();
    assert_eq!(e.key.as_deref(), Some("variability.distributions.table"));
    assert!(e.rule.contains("file not found"), "{e}");
    assert_eq!(
        e.location.map(|(l, _)| l),
        Some(line_of(
            "[variability.distributions]\ntable = \"nope.csv\"\n",
            "table ="
        ))
    );
    std::fs::remove_dir_all(&dir).ok();
    let _: PathBuf = dir;
}

#[test]
fn overrides() {
    let j = ok(
        FULL,
        &[
            "variability.gpu_outlier_fraction=0.02",
            "variability.seed=7",
            "variability.failures.restart_s=300",
            "variability.fail_slow.slowdown=3",
            "variability.gpu_speed.std=0.05",
            "variability.kernel_jitter.gemm.sigma=0.1",
            "variability.comm_regime={ dist = \"gamma\", shape = 2, scale = 0.5 }",
            "variability.kernel_jitter.loss=1.2",
        ],
    );
    let v = &j.variability;
    assert_eq!(j.variability_seed, Some(7));
    let gs = v.gpu_speed.as_ref().unwrap();
    assert_eq!(gs.outlier_fraction, 0.02);
    assert_eq!(
        gs.factor,
        Dist::Normal {
            mean: 1.0,
            std: 0.05
        }
    );
    assert_eq!(v.failures.as_ref().unwrap().restart_s, 300.0);
    assert_eq!(v.fail_slow.as_ref().unwrap().slowdown, 3.0);
    let gemm = v.kernel_jitter.iter().find(|k| k.class == "gemm").unwrap();
    assert_eq!(
        gemm.factor,
        Dist::LogNormal {
            mu: 0.0,
            sigma: 0.1
        }
    );
    let loss = v.kernel_jitter.iter().find(|k| k.class == "loss").unwrap();
    assert_eq!(loss.factor, Dist::Constant(1.2));
    assert_eq!(
        v.comm_regime.as_ref().unwrap().factor,
        Dist::Gamma {
            shape: 2.0,
            scale: 0.5
        }
    );

    // Overrides create what the file lacks.
    let j = ok(
        "",
        &[
            "variability.failures.rate_per_gpu_hour=2e-5",
            "variability.failures.checkpoint_interval_s=1200",
            "variability.gpu_speed.dist=lognormal",
            "variability.gpu_speed.mu=0",
            "variability.gpu_speed.sigma=0.03",
        ],
    );
    assert_eq!(
        j.variability.failures,
        Some(Failures {
            rate_per_gpu_hour: 2e-5,
            checkpoint_interval_s: 1200.0,
            checkpoint_write_s: 0.0,
            restart_s: 0.0,
        })
    );
    assert_eq!(
        j.variability.gpu_speed.unwrap().factor,
        Dist::LogNormal {
            mu: 0.0,
            sigma: 0.03
        }
    );
    // Empirical values through an override.
    let j = ok(
        "",
        &["variability.comm_regime={dist=\"empirical\", values=[1, 1.5]}"],
    );
    assert_eq!(
        j.variability.comm_regime.unwrap().factor,
        Dist::Empirical(vec![1.0, 1.5])
    );
}

// ---------------------------------------------------------------------------------------------
// Bad input
// ---------------------------------------------------------------------------------------------

#[test]
fn unknown_key_did_you_mean() {
    let var = "[variability]\ngpu_outlier_fractoin = 0.1\n";
    let e = fails(
        var,
        &[],
        "variability.gpu_outlier_fractoin",
        &["unknown key", "did you mean `gpu_outlier_fraction`?"],
    );
    assert_eq!(e.location, Some((line_of(var, "gpu_outlier_fractoin"), 1)));
    // A misspelt sub-table.
    fails(
        "[variability.failure]\nrestart_s = 1\n",
        &[],
        "variability.failure",
        &["unknown key", "did you mean `failures`?"],
    );
    // A key of a sub-table given at the top of [variability] is sent home.
    fails(
        "[variability]\nrestart_s = 600\n",
        &[],
        "variability.restart_s",
        &["belongs in `[variability.failures]`"],
    );
    fails(
        "[variability.failures]\nrate_per_gpu_hour = 1e-5\ncheckpoint_interval_s = 60\nrestart = 5\n",
        &[],
        "variability.failures.restart",
        &["unknown key", "did you mean `restart_s`?"],
    );
}

#[test]
fn unknown_kernel_class() {
    let var = "[variability.kernel_jitter]\ngemn = 1.01\n";
    let e = fails(
        var,
        &[],
        "variability.kernel_jitter.gemn",
        &["unknown key", "did you mean `gemm`?"],
    );
    assert_eq!(e.location, Some((line_of(var, "gemn"), 1)));
    fails(
        "[variability.kernel_jitter]\nconvolution = 1.01\n",
        &[],
        "variability.kernel_jitter.convolution",
        &["unknown key", "`gemm`", "`attention`", "`all`"],
    );
}

#[test]
fn negative_rates_and_durations() {
    let var = "[variability.failures]\nrate_per_gpu_hour = -1e-5\ncheckpoint_interval_s = 60\n";
    let e = fails(
        var,
        &[],
        "variability.failures.rate_per_gpu_hour",
        &["must not be negative", "-0.00001"],
    );
    assert_eq!(e.location, Some((line_of(var, "rate_per_gpu_hour"), 21)));
    fails(
        "[variability.fail_slow]\nrate_per_gpu_hour = -1\nduration_s = 60\nslowdown = 2\n",
        &[],
        "variability.fail_slow.rate_per_gpu_hour",
        &["must not be negative"],
    );
    fails(
        "[variability.failures]\nrate_per_node_day = -0.1\ncheckpoint_interval_s = 60\n",
        &[],
        "variability.failures.rate_per_node_day",
        &["must not be negative"],
    );
    fails(
        "[variability.failures]\nrate_per_gpu_hour = 1e-5\ncheckpoint_interval_s = 0\n",
        &[],
        "variability.failures.checkpoint_interval_s",
        &["must be positive", "got 0"],
    );
    fails(
        "[variability.failures]\nrate_per_gpu_hour = 1e-5\ncheckpoint_interval_s = 60\nrestart_s = -5\n",
        &[],
        "variability.failures.restart_s",
        &["must not be negative"],
    );
    fails(
        "[variability.failures]\nrate_per_gpu_hour = 1e-5\ncheckpoint_interval_s = 60\ncheckpoint_write_s = -1\n",
        &[],
        "variability.failures.checkpoint_write_s",
        &["must not be negative"],
    );
    fails(
        "[variability.fail_slow]\nrate_per_gpu_hour = 1e-5\nduration_s = -60\nslowdown = 2\n",
        &[],
        "variability.fail_slow.duration_s",
        &["must be positive"],
    );
}

#[test]
fn fractions_and_factors_out_of_range() {
    let var = "[variability]\ngpu_outlier_fraction = 1.5\ngpu_outlier_slowdown = 1.2\n";
    let e = fails(
        var,
        &[],
        "variability.gpu_outlier_fraction",
        &["must be a fraction in [0, 1]", "got 1.5"],
    );
    assert_eq!(e.location, Some((line_of(var, "gpu_outlier_fraction"), 24)));
    fails(
        "[variability]\ngpu_outlier_fraction = -0.1\n",
        &[],
        "variability.gpu_outlier_fraction",
        &["must be a fraction in [0, 1]"],
    );
    fails(
        "[variability]\ngpu_outlier_slowdown = 0\n",
        &[],
        "variability.gpu_outlier_slowdown",
        &["must be positive"],
    );
    fails(
        "[variability.fail_slow]\nrate_per_gpu_hour = 1e-5\nduration_s = 60\nslowdown = 0.5\n",
        &[],
        "variability.fail_slow.slowdown",
        &["must be at least 1", "got 0.5"],
    );
    fails(
        "[variability]\ngpu_speed = { dist = \"normal\", mean = 0, std = 0.1 }\n",
        &[],
        "variability.gpu_speed.mean",
        &["must be positive"],
    );
    fails(
        "[variability]\ngpu_speed = { dist = \"lognormal\", mu = 0, sigma = -0.1 }\n",
        &[],
        "variability.gpu_speed.sigma",
        &["must not be negative"],
    );
    fails(
        "[variability]\ngpu_speed = -1\n",
        &[],
        "variability.gpu_speed",
        &["a constant distribution must be positive"],
    );
    fails(
        "[variability.kernel_jitter]\nnorm = { dist = \"gamma\", shape = 0, scale = 1 }\n",
        &[],
        "variability.kernel_jitter.norm.shape",
        &["must be positive"],
    );
}

#[test]
fn bad_distribution_name() {
    let var = "[variability]\ngpu_speed = { dist = \"lognormla\", mu = 0, sigma = 0.1 }\n";
    let e = fails(
        var,
        &[],
        "variability.gpu_speed.dist",
        &["unknown distribution", "did you mean \"lognormal\"?"],
    );
    assert_eq!(e.location, Some((line_of(var, "gpu_speed"), 22)));
    fails(
        "[variability.kernel_jitter]\ngemm = { dist = \"weibull\", shape = 2 }\n",
        &[],
        "variability.kernel_jitter.gemm.dist",
        &["\"normal\"", "\"lognormal\"", "\"empirical\""],
    );
    fails(
        "[variability]\ncomm_regime = { mu = 0, sigma = 0.1 }\n",
        &[],
        "variability.comm_regime.dist",
        &["missing required key", "needs `dist`"],
    );
}

#[test]
fn missing_distribution_parameter() {
    let var = "[variability]\ngpu_speed = { dist = \"normal\", mean = 1.0 }\n";
    let e = fails(
        var,
        &[],
        "variability.gpu_speed.std",
        &[
            "missing required key",
            "dist \"normal\" needs `mean` and `std`",
        ],
    );
    // Located at the distribution's table.
    assert_eq!(e.location, Some((line_of(var, "gpu_speed"), 13)));
    fails(
        "[variability.fail_slow]\nrate_per_gpu_hour = 1e-5\nduration_s = { dist = \"exponential\" }\nslowdown = 2\n",
        &[],
        "variability.fail_slow.duration_s.mean",
        &["missing required key"],
    );
    fails(
        "[variability]\ncomm_regime = { dist = \"empirical\" }\n",
        &[],
        "variability.comm_regime.values",
        &["missing required key"],
    );
    // A parameter of another distribution.
    let var = "[variability]\ngpu_speed = { dist = \"normal\", mean = 1.0, sigma = 0.1 }\n";
    let e = fails(
        var,
        &[],
        "variability.gpu_speed.sigma",
        &["not a parameter of dist \"normal\"", "`mean` and `std`"],
    );
    assert_eq!(e.location, Some((line_of(var, "gpu_speed"), 44)));
    // A parameter no distribution has.
    fails(
        "[variability]\ngpu_speed = { dist = \"normal\", mean = 1.0, sd = 0.1 }\n",
        &[],
        "variability.gpu_speed.sd",
        &["unknown distribution parameter", "did you mean `std`?"],
    );
}

#[test]
fn required_keys() {
    fails(
        "[variability.failures]\ncheckpoint_interval_s = 60\n",
        &[],
        "variability.failures.rate_per_gpu_hour",
        &["missing required key", "rate_per_node_day"],
    );
    fails(
        "[variability.failures]\nrate_per_gpu_hour = 1e-5\n",
        &[],
        "variability.failures.checkpoint_interval_s",
        &["missing required key"],
    );
    fails(
        "[variability.failures]\nrate_per_gpu_hour = 1e-5\nrate_per_node_day = 1e-3\ncheckpoint_interval_s = 60\n",
        &[],
        "variability.failures.rate_per_node_day",
        &["both given; give only one"],
    );
    fails(
        "[variability.fail_slow]\nrate_per_gpu_hour = 1e-5\nslowdown = 2\n",
        &[],
        "variability.fail_slow.duration_s",
        &["missing required key"],
    );
    fails(
        "[variability.fail_slow]\nrate_per_gpu_hour = 1e-5\nduration_s = 60\n",
        &[],
        "variability.fail_slow.slowdown",
        &["missing required key"],
    );
    fails(
        "[variability]\ngpu_outlier_fraction = 0.1\n",
        &[],
        "variability.gpu_outlier_slowdown",
        &["missing required key", "gpu_outlier_fraction > 0"],
    );
}

#[test]
fn nan_and_infinity() {
    fails(
        "[variability.fail_slow]\nrate_per_gpu_hour = 1e-5\nduration_s = 60\nslowdown = nan\n",
        &[],
        "variability.fail_slow.slowdown",
        &["must be a finite number", "NaN"],
    );
    fails(
        "[variability]\ngpu_speed = { dist = \"normal\", mean = inf, std = 0.1 }\n",
        &[],
        "variability.gpu_speed.mean",
        &["must be a finite number"],
    );
    fails(
        "[variability.kernel_jitter]\ngemm = { dist = \"empirical\", values = [1.0, nan] }\n",
        &[],
        "variability.kernel_jitter.gemm.values",
        &["element 1", "must be a positive finite number"],
    );
    fails(
        "[variability.failures]\nrate_per_gpu_hour = -inf\ncheckpoint_interval_s = 60\n",
        &[],
        "variability.failures.rate_per_gpu_hour",
        &["must be a finite number"],
    );
}

#[test]
fn wrong_types() {
    fails(
        "[variability.failures]\nrate_per_gpu_hour = 1e-5\ncheckpoint_interval_s = 60\nrestart_s = \"600\"\n",
        &[],
        "variability.failures.restart_s",
        &["expected a number, found string \"600\""],
    );
    fails(
        "[variability]\ngpu_speed = \"normal\"\n",
        &[],
        "variability.gpu_speed",
        &["expected a distribution", "found string \"normal\""],
    );
    fails(
        "[variability]\nseed = 1.5\n",
        &[],
        "variability.seed",
        &["expected a non-negative integer, found float 1.5"],
    );
    fails(
        "[variability]\nseed = -1\n",
        &[],
        "variability.seed",
        &["must not be negative"],
    );
    fails(
        "[variability]\nseed = 18446744073709551616\n",
        &[],
        "variability.seed",
        &["is too large"],
    );
    fails(
        "[variability]\nfailures = 3\n",
        &[],
        "variability.failures",
        &["must be a section (`[variability.failures]`), found integer 3"],
    );
    let e = load_job_str(&format!("variability = 3\n{SMALL}"), "test.toml", None, &[]).unwrap_err();
    assert_eq!(e.key.as_deref(), Some("variability"));
    assert!(
        e.rule.contains("must be a section (`[variability]`)"),
        "{e}"
    );
    fails(
        "[variability]\ngpu_speed = { dist = 1 }\n",
        &[],
        "variability.gpu_speed.dist",
        &["expected a string, found integer 1"],
    );
    fails(
        "[variability]\ncomm_regime = { dist = \"empirical\", values = 1.0 }\n",
        &[],
        "variability.comm_regime.values",
        &["expected an array of numbers"],
    );
    fails(
        "[variability]\ncomm_regime = { dist = \"empirical\", values = [] }\n",
        &[],
        "variability.comm_regime.values",
        &["at least one value"],
    );
    fails(
        "[variability]\ncomm_regime = { dist = \"empirical\", values = [1.0, \"x\"] }\n",
        &[],
        "variability.comm_regime.values",
        &["element 1: expected a number"],
    );
    fails(
        "[variability.distributions]\ntable = 5\n",
        &[],
        "variability.distributions.table",
        &["expected a string"],
    );
    // Arrays elsewhere still read as before.
    let e = load_job_str(&SMALL.replace("tp = 4", "tp = [4]"), "test.toml", None, &[]).unwrap_err();
    assert!(e.to_string().contains("found an array"), "{e}");
}

#[test]
fn bad_overrides() {
    let e = fails(
        "",
        &["variability.gpu_outlier_fraction=2"],
        "variability.gpu_outlier_fraction",
        &["must be a fraction in [0, 1]"],
    );
    assert_eq!(
        e.via.as_deref(),
        Some("set by `--set variability.gpu_outlier_fraction=2`")
    );
    fails(
        "",
        &["variability.gpu_outlier_fractoin=0.1"],
        "variability.gpu_outlier_fractoin",
        &["did you mean `gpu_outlier_fraction`?"],
    );
    fails(
        "",
        &["variability.failures.restrat_s=1"],
        "variability.failures.restrat_s",
        &["did you mean `restart_s`?"],
    );
    fails(
        "",
        &["variability.failures=1"],
        "variability.failures",
        &[
            "name a key inside the table",
            "variability.failures.<key>=value",
        ],
    );
    fails(
        "",
        &["variability.gpu_speed.sd=1"],
        "variability.gpu_speed.sd",
        &["unknown distribution parameter", "did you mean `std`?"],
    );
    fails(
        "",
        &["variability.seed.x=1"],
        "variability.seed.x",
        &["bad override: keys have the form"],
    );
    fails(
        "",
        &["variability.kernel_jitter.gemn.sigma=1"],
        "variability.kernel_jitter.gemn.sigma",
        &["did you mean `gemm`?"],
    );
    // Switching a distribution's kind keeps the old parameters: named as foreign.
    fails(
        FULL,
        &["variability.gpu_speed.dist=lognormal"],
        "variability.gpu_speed.mean",
        &["not a parameter of dist \"lognormal\""],
    );
    // A parameter set on a distribution the file lacks: the table needs `dist`.
    fails(
        "",
        &["variability.gpu_speed.std=0.1"],
        "variability.gpu_speed.dist",
        &["missing required key"],
    );
    // Existing override forms keep their messages.
    let e = load_job_str(SMALL, "test.toml", None, &sets(&["parallel.tp.x=1"])).unwrap_err();
    assert!(e.rule.contains("bad override: keys have the form"), "{e}");
}
