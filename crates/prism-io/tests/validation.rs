//! The validation case set (`validation/cases.csv`) and its runner.
//!
//! Checks that the case file parses, lists every calibration row exactly once, that every
//! modelled case builds a valid job and simulates to a finite, positive prediction, and prints the
//! comparison table with per-source MAPE. No accuracy threshold is asserted yet: calibration comes
//! next.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use prism_core::SimOptions;
use prism_io::jobfile::load_job_str;
use prism_io::validation::{
    Case, CaseOptions, Compare, Metric, Status, parse_cases, read_cases, results_table, run_case,
    run_case_with, stats, stats_by, stats_table,
};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn cases() -> Vec<Case> {
    let path = repo_root().join("validation/cases.csv");
    read_cases(&path).unwrap_or_else(|e| panic!("{e}"))
}

/// Cases of `cases.csv` that are not rows of the shared calibration set: published large
/// mixture-of-experts training runs (validation/README.md, "Large MoE runs").
const MOE_IDS: [&str; 8] = [
    "dsv3_pretrain",
    "dsv2_pretrain",
    "automodel_dsv3_256",
    "automodel_dsv3_1024",
    "automodel_qwen3_30b_8",
    "automodel_gptoss120_64",
    "automodel_gptoss20_8",
    "automodel_kimik2_256",
];

/// Ids of `shared/validation/calibration.csv` (first column), if the shared folder is there
/// (inside the checkout or beside it).
fn calibration_ids() -> Option<Vec<String>> {
    let text = ["shared", "../shared"].iter().find_map(|dir| {
        std::fs::read_to_string(repo_root().join(dir).join("validation/calibration.csv")).ok()
    })?;
    let mut ids = Vec::new();
    let mut in_quotes = false;
    let mut at_line_start = true;
    let mut current = String::new();
    let mut collecting = true;
    // A minimal CSV scan: the id is the first field of every record after the header.
    for c in text.chars() {
        if at_line_start {
            current.clear();
            collecting = true;
            at_line_start = false;
        }
        match c {
            '"' => in_quotes = !in_quotes,
            ',' if !in_quotes && collecting => {
                ids.push(std::mem::take(&mut current));
                collecting = false;
            }
            '\n' if !in_quotes => at_line_start = true,
            c if collecting => current.push(c),
            _ => {}
        }
    }
    ids.remove(0); // header
    Some(ids)
}

#[test]
fn cases_parse_and_cover_calibration() {
    let cases = cases();
    assert!(!cases.is_empty());
    let ids: Vec<&str> = cases.iter().map(|c| c.id.as_str()).collect();
    let unique: BTreeSet<&str> = ids.iter().copied().collect();
    assert_eq!(unique.len(), ids.len(), "duplicate ids");
    // One case per calibration row, plus the published large MoE runs, NeMo's nine
    // long-sequence runs and Megatron-Bridge's four H100 runs (two dense, modelled; two MoE,
    // excluded with Prism's error), none of them in the shared calibration set.
    let long_sequence = ids.iter().filter(|i| i.starts_with("nemo2403cp_")).count();
    assert_eq!(long_sequence, 9);
    let bridge = ids.iter().filter(|i| i.starts_with("mbridge2604_")).count();
    assert_eq!(bridge, 4);
    assert_eq!(
        cases.len(),
        94 + MOE_IDS.len() + long_sequence + bridge,
        "one case per calibration row, plus MoE, long-sequence and Megatron-Bridge runs"
    );
    for id in MOE_IDS {
        assert!(unique.contains(id), "MoE case {id}");
    }
    for c in &cases {
        assert!(c.published > 0.0 && c.tolerance_pct > 0.0, "{}", c.id);
        if c.metric.is_fraction() {
            assert!(c.published <= 1.0, "{}", c.id);
        }
        if let Status::Excluded(why) = &c.status {
            assert!(!why.is_empty(), "{}", c.id);
        }
        assert!(c.job_toml.contains(&format!("name = \"{}\"", c.id)));
    }
    match calibration_ids() {
        Some(cal) => {
            let cal_set: BTreeSet<&str> = cal.iter().map(String::as_str).collect();
            assert_eq!(cal.len(), 94, "calibration.csv rows");
            assert_eq!(cal_set.len(), cal.len(), "calibration.csv ids unique");
            let not_moe: BTreeSet<&str> = unique
                .iter()
                .copied()
                .filter(|id| {
                    !MOE_IDS.contains(id)
                        && !id.starts_with("nemo2403cp_")
                        && !id.starts_with("mbridge2604_")
                })
                .collect();
            assert_eq!(
                not_moe, cal_set,
                "cases.csv ids = calibration.csv ids + MoE, long-sequence and Megatron-Bridge runs"
            );
        }
        None => eprintln!("shared/validation/calibration.csv not found: id comparison skipped"),
    }
    let modelled = cases.iter().filter(|c| c.status.is_modelled()).count();
    println!(
        "{} cases: {modelled} modelled, {} excluded",
        cases.len(),
        cases.len() - modelled
    );
}

#[test]
fn every_modelled_case_builds_a_valid_job() {
    for c in cases().iter().filter(|c| c.status.is_modelled()) {
        let loaded = load_job_str(&c.job_toml, &c.id, None, &[])
            .unwrap_or_else(|e| panic!("{}: {e}\n{}", c.id, c.job_toml));
        loaded.job.validate().unwrap();
        // Utilisation cases must compare like with like (the 16-bit peak, which FP16 and
        // BF16 share).
        if c.metric.is_fraction() {
            assert_ne!(
                loaded.job.training.precision,
                prism_core::job::Precision::Fp8,
                "{}",
                c.id
            );
            assert_eq!(
                loaded.job.peak_flops(),
                loaded.job.cluster.gpu.peak_tflops_bf16 * 1e12
            );
        }
    }
}

#[test]
fn excluded_cases_do_not_run() {
    let c = cases()
        .into_iter()
        .find(|c| !c.status.is_modelled())
        .expect("an excluded case");
    let e = run_case(&c, &SimOptions::default()).unwrap_err();
    assert!(e.contains("excluded"), "{e}");
}

#[test]
fn run_all_modelled_cases() {
    let cases = cases();
    let opts = SimOptions::default();
    let mut results = Vec::new();
    for c in cases.iter().filter(|c| c.status.is_modelled()) {
        let r = run_case(c, &opts).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            r.predicted.is_finite() && r.predicted > 0.0,
            "{}: {}",
            c.id,
            r.predicted
        );
        assert!(r.error_pct.is_finite());
        // Every published run ran: its peak memory in Prism's model may exceed the GPU's by
        // no more than the model's resolution (1%).
        assert!(
            r.peak_memory_gib <= 1.01 * r.hbm_gib,
            "{}: {:.1} GiB on a {} GiB GPU",
            c.id,
            r.peak_memory_gib,
            r.hbm_gib
        );
        results.push(r);
    }
    println!("\n{}", results_table(&results));
    let (per, overall) = stats(&results);
    println!("{}", stats_table(&per, &overall));
    let mut worst: Vec<_> = results.iter().collect();
    worst.sort_by(|a, b| b.error_pct.abs().total_cmp(&a.error_pct.abs()));
    println!("worst cases:");
    for r in worst.iter().take(5) {
        println!("  {:<26} {:>+7.1} %", r.id, r.error_pct);
    }
    assert_eq!(overall.count, results.len());
    assert_eq!(per.iter().map(|s| s.count).sum::<usize>(), results.len());
    assert!(overall.mape.is_finite() && overall.max_abs >= overall.mape);
}

const HEADER: &str = "id,source,metric,published,tolerance_pct,status,exclusion_reason,\
model_preset,cluster_preset,nodes,tp,pp,dp,global_batch,precision,overrides,assumptions\n";

fn one_case(row: &str) -> Result<Vec<Case>, prism_io::validation::ValidationError> {
    parse_cases(&format!("{HEADER}{row}\n"), "cases.csv")
}

#[test]
fn a_minimal_case_parses_and_runs() {
    let cases = one_case(
        "t1,Test,mfu,0.4,20,modelled,,llama3-8b,dgx-h100,1,8,1,1,8,bf16,,\"tp 8 \"\"assumed\"\"\"",
    )
    .unwrap();
    let c = &cases[0];
    assert_eq!(c.metric, Metric::Mfu);
    assert_eq!(c.assumptions, "tp 8 \"assumed\"");
    assert!(c.job_toml.contains("[parallel]\ntp = 8\npp = 1\ndp = 1\n"));
    assert!(c.job_toml.contains("# Assumptions: tp 8 \"assumed\""));
    let r = run_case(c, &SimOptions::default()).unwrap();
    assert!(r.predicted > 0.0 && r.predicted < 1.0);
    assert_eq!(
        r.error_pct,
        (r.predicted - 0.4) / 0.4 * 100.0,
        "signed error in percent"
    );
}

/// Both predictions of a case come from one simulation: the straggler one is the nominal one
/// at `E[T] = T + compute x cv x E[max of N standard normals]`, checked here against the
/// tabulated order statistic for N = 32 (E[max] = 2.0697, Tippett 1925), for a rate and for an
/// iteration time; `compare` picks which one is the case's error and tolerance verdict.
#[test]
fn straggler_predictions_follow_the_order_statistic() {
    let rate =
        &one_case("t1,Test,mfu,0.4,20,modelled,,llama3-8b,dgx-h100,4,8,1,4,32,bf16,,").unwrap()[0];
    let time =
        &one_case("t2,Test,iteration_time_s,2.0,20,modelled,,llama3-8b,dgx-h100,4,8,1,4,32,bf16,,")
            .unwrap()[0];
    let opts = SimOptions::default();
    // The nominal iteration and its compute, simulated directly.
    let job = load_job_str(&rate.job_toml, "t1", None, &[]).unwrap().job;
    assert_eq!(job.num_gpus(), 32);
    let mut o = opts.clone();
    o.mode = prism_core::Mode::Reduced;
    let s = prism_core::engine::simulate_or_full(&job, &o)
        .unwrap()
        .summary;
    let cv = 0.02;
    let expected = s.iteration_time_s + s.breakdown.compute_s * cv * 2.0697;
    let how = CaseOptions {
        compare: Compare::Stragglers,
        gpu_speed_cv: Some(cv),
    };
    let r = run_case_with(rate, &opts, &how).unwrap();
    assert_eq!(r.num_gpus, 32);
    assert_eq!(r.gpu_speed_cv, cv);
    assert_eq!(r.predicted_nominal, s.mfu);
    let want = s.mfu * s.iteration_time_s / expected;
    assert!(
        (r.predicted_stragglers / want - 1.0).abs() < 1e-4,
        "MFU with stragglers {} vs closed form {want}",
        r.predicted_stragglers
    );
    assert!(r.predicted_stragglers < r.predicted_nominal);
    assert_eq!(r.compared, Compare::Stragglers);
    assert_eq!(r.predicted, r.predicted_stragglers);
    assert_eq!(r.error_pct, r.error_stragglers_pct);
    assert_eq!(r.other_error_pct(), r.error_nominal_pct);
    let t = run_case_with(time, &opts, &how).unwrap();
    assert_eq!(t.predicted_nominal, s.iteration_time_s);
    assert!((t.predicted_stragglers / expected - 1.0).abs() < 1e-4);
    // The default compares the nominal prediction and reports the other beside it.
    let n = run_case(rate, &opts).unwrap();
    assert_eq!(n.compared, Compare::Nominal);
    assert_eq!(n.predicted, n.predicted_nominal);
    assert_eq!(n.error_pct, n.error_nominal_pct);
    assert_eq!(n.other_error_pct(), n.error_stragglers_pct);
    assert_eq!(n.gpu_speed_cv, prism_core::straggler::DEFAULT_GPU_SPEED_CV);
    // No spread: both predictions are the same number.
    let zero = CaseOptions {
        compare: Compare::Stragglers,
        gpu_speed_cv: Some(0.0),
    };
    let z = run_case_with(rate, &opts, &zero).unwrap();
    assert_eq!(z.predicted_stragglers, z.predicted_nominal);
    // Statistics of either error.
    let (_, all) = stats_by(&[r.clone(), n.clone()], |x| x.error_nominal_pct);
    assert_eq!(all.max_abs, r.error_nominal_pct.abs());
    // A spread outside 0..0.5 is refused.
    let bad = CaseOptions {
        compare: Compare::Nominal,
        gpu_speed_cv: Some(0.7),
    };
    let e = run_case_with(rate, &opts, &bad).unwrap_err();
    assert!(e.contains("0.7") && e.contains("0 to 0.5"), "{e}");
}

#[test]
fn parse_errors_name_line_and_column() {
    // Unknown metric: line 2, column of the third field.
    let e = one_case("t1,Test,tflops,0.4,20,modelled,,llama3-8b,dgx-h100,1,8,1,1,8,bf16,,")
        .unwrap_err();
    assert_eq!(e.location, Some((2, 9)));
    assert_eq!(e.column.as_deref(), Some("metric"));
    assert!(
        e.to_string()
            .starts_with("cases.csv:2:9: column `metric`: unknown metric `tflops`"),
        "{e}"
    );

    // A percentage written as a percentage.
    let e =
        one_case("t1,Test,mfu,41,20,modelled,,llama3-8b,dgx-h100,1,8,1,1,8,bf16,,").unwrap_err();
    assert_eq!(
        (e.location, e.column.as_deref()),
        (Some((2, 13)), Some("published"))
    );

    // Excluded without a reason.
    let e =
        one_case("t1,Test,mfu,0.4,20,excluded,,llama3-8b,dgx-h100,1,8,1,1,8,bf16,,").unwrap_err();
    assert_eq!(e.column.as_deref(), Some("exclusion_reason"));

    // Not an integer.
    let e = one_case("t1,Test,mfu,0.4,20,modelled,,llama3-8b,dgx-h100,1,eight,1,1,8,bf16,,")
        .unwrap_err();
    assert_eq!(
        (e.location, e.column.as_deref()),
        (Some((2, 51)), Some("tp"))
    );

    // Unknown preset, with a suggestion.
    let e =
        one_case("t1,Test,mfu,0.4,20,modelled,,llama3-8bb,dgx-h100,1,8,1,1,8,bf16,,").unwrap_err();
    assert_eq!(e.column.as_deref(), Some("model_preset"));
    assert!(e.rule.contains("did you mean `llama3-8b`"), "{e}");

    // A job rule broken: reported at the column that set the key (dp: 8 x 1 x 2 != 8 GPUs).
    let e =
        one_case("t1,Test,mfu,0.4,20,modelled,,llama3-8b,dgx-h100,1,8,1,2,8,bf16,,").unwrap_err();
    assert_eq!(
        (e.location, e.column.as_deref()),
        (Some((2, 55)), Some("dp"))
    );
    assert!(e.rule.contains("parallel.dp"), "{e}");

    // MFU of an FP8 job.
    let e =
        one_case("t1,Test,mfu,0.4,20,modelled,,llama3-8b,dgx-h100,1,8,1,1,8,fp8,,").unwrap_err();
    assert_eq!(e.column.as_deref(), Some("metric"));

    // Bad override and a key set twice.
    let e = one_case(
        "t1,Test,mfu,0.4,20,modelled,,llama3-8b,dgx-h100,1,8,1,1,8,bf16,cluster.gpu=A100,",
    )
    .unwrap_err();
    assert_eq!(e.column.as_deref(), Some("overrides"));
    let e =
        one_case("t1,Test,mfu,0.4,20,modelled,,llama3-8b,dgx-h100,1,8,1,1,8,bf16,parallel.tp=4,")
            .unwrap_err();
    assert!(e.rule.contains("already set by column `tp`"), "{e}");

    // Wrong field count, unterminated quote, unknown and missing columns, duplicate id.
    let e = one_case("t1,Test,mfu,0.4").unwrap_err();
    assert_eq!(e.location.map(|l| l.0), Some(2));
    assert!(e.rule.contains("4 fields"), "{e}");
    let e = one_case("t1,\"Test,mfu").unwrap_err();
    assert_eq!(e.location, Some((2, 4)));
    let e = parse_cases("id,source,metrc\n", "x.csv").unwrap_err();
    assert_eq!(e.location, Some((1, 11)));
    assert!(e.rule.contains("did you mean `metric`"), "{e}");
    let e = parse_cases("id,source\n", "x.csv").unwrap_err();
    assert_eq!(e.column.as_deref(), Some("metric"));
    let row = "t1,Test,mfu,0.4,20,modelled,,llama3-8b,dgx-h100,1,8,1,1,8,bf16,,";
    let e = parse_cases(&format!("{HEADER}{row}\n{row}\n"), "cases.csv").unwrap_err();
    assert_eq!(
        (e.location, e.column.as_deref()),
        (Some((3, 1)), Some("id"))
    );
    assert!(e.rule.contains("first on line 2"), "{e}");
}

#[test]
fn metric_names_round_trip() {
    for m in Metric::ALL {
        assert_eq!(Metric::from_name(m.name()), Some(m));
    }
    assert_eq!(Metric::from_name("MFU"), None);
}
