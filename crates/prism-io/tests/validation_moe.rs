//! Published large mixture-of-experts training runs (the MoE rows of `validation/cases.csv`:
//! DeepSeek-V3 and -V2 on H800, DeepSeek-V3 under NeMo AutoModel on H100). Every modelled one
//! parses, builds a valid job and simulates, within its tolerance; the comparison table is
//! printed, and DeepSeek-V3's published cost is predicted and printed beside the published
//! figure in GPU hours per trillion tokens.

use std::path::PathBuf;

use prism_core::SimOptions;
use prism_io::validation::{
    read_cases, results_table, run_case, source_prefix, stats, stats_table,
};

fn cases_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../validation/cases.csv")
}

#[test]
fn moe_cases_run_and_deepseek_v3_cost_is_reported() {
    // The MoE rows (after the calibration set): DeepSeek's own runs and NeMo AutoModel's.
    let cases: Vec<_> = (read_cases(&cases_path()).unwrap_or_else(|e| panic!("{e}")))
        .into_iter()
        .filter(|c| matches!(source_prefix(&c.id), "dsv3" | "dsv2" | "automodel"))
        .collect();
    assert_eq!(cases.len(), 8, "MoE rows");
    let mut results = Vec::new();
    for c in cases.iter().filter(|c| c.status.is_modelled()) {
        let r = run_case(c, &SimOptions::default()).unwrap_or_else(|e| panic!("{}: {e}", c.id));
        assert!(r.predicted.is_finite() && r.predicted > 0.0, "{}", c.id);
        assert!(
            r.error_pct.abs() <= c.tolerance_pct,
            "{}: {:+.1}%",
            c.id,
            r.error_pct
        );
        // The runs ran on 80 GiB GPUs: Prism's memory model must fit them.
        assert!(
            r.fits(),
            "{}: {:.1} GiB > {} GiB",
            c.id,
            r.peak_memory_gib,
            r.hbm_gib
        );
        results.push(r);
    }
    assert!(
        results.len() >= 6,
        "DeepSeek-V3 on H800, five AutoModel runs on H100"
    );
    println!("\n{}", results_table(&results));
    let (per, overall) = stats(&results);
    println!("{}", stats_table(&per, &overall));
    // DeepSeek-V3: 180K H800 GPU hours per trillion tokens; 2.664M for 14.8T tokens.
    let v3 = results
        .iter()
        .find(|r| r.id == "dsv3_pretrain")
        .expect("dsv3 case");
    let hours_per_t = |tokens_per_s_per_gpu: f64| 1e12 / tokens_per_s_per_gpu / 3600.0;
    let published = hours_per_t(v3.published);
    let predicted = hours_per_t(v3.predicted);
    assert!((published / 180e3 - 1.0).abs() < 1e-4, "{published}");
    println!(
        "DeepSeek-V3 pre-training: predicted {:.0}K H800 GPU hours per trillion tokens \
         (published 180K), {:.3}M GPU hours for 14.8T tokens (published 2.664M); \
         {:+.1} % error in throughput",
        predicted / 1e3,
        predicted * 14.8 / 1e6,
        v3.error_pct
    );
}
