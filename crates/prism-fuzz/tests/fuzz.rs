//! The fuzzer's regressions replay without a panic, and a short deterministic run finds nothing.

use prism_fuzz::{Outcome, Target, fuzz, run_case};

/// The timed regression replay and the short fuzz run share rayon's global pool; run in
/// parallel, a regression case waiting on its own parallel work can pick up (and must finish) a
/// long task of the other test, and its measured time is then that task's. One at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Every file under `regressions/<target>/` (inputs that once crashed Prism, or the hostile
/// inputs of issue 13) is answered: a value or an error, never a panic, within the time limit.
#[test]
fn regressions_are_answered() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("regressions");
    let mut n = 0;
    for t in Target::ALL {
        let dir = root.join(t.name());
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        let mut files: Vec<_> = entries.map(|e| e.unwrap().path()).collect();
        files.sort();
        for f in files {
            let input = std::fs::read_to_string(&f).unwrap();
            let (o, d) = run_case(t, &input);
            assert!(!matches!(o, Outcome::Panicked(_)), "{}: {o:?}", f.display());
            assert!(
                d.as_secs_f64() < prism_fuzz::SLOW_S,
                "{}: {d:?}",
                f.display()
            );
            n += 1;
        }
    }
    assert!(n >= 4, "only {n} regression files");
}

/// The mutations are a pure function of (seed, index): the same case twice is the same input.
#[test]
fn cases_are_deterministic() {
    for t in Target::ALL {
        assert_eq!(
            prism_fuzz::case_input(t, 9, 17),
            prism_fuzz::case_input(t, 9, 17)
        );
        assert_ne!(
            prism_fuzz::case_input(t, 9, 17),
            prism_fuzz::case_input(t, 9, 18)
        );
    }
}

/// A short run over every target: no finding, and both outcomes occur (the mutations neither
/// always break nor never break the input).
#[test]
fn a_short_run_finds_nothing() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    prism_fuzz::quiet_panics();
    for t in Target::ALL {
        let tally = fuzz(t, 2026, 0, 60, &|_, _| {});
        assert!(
            tally.findings.is_empty(),
            "{}: {:?}",
            t.name(),
            tally.findings
        );
        assert!(
            tally.accepted > 0 && tally.refused > 0,
            "{}: {tally:?}",
            t.name()
        );
    }
}
