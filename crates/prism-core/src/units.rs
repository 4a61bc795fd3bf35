//! Simulated time. The engine counts integer picoseconds so that event order and every reported
//! number are exact and reproducible.

/// Picoseconds per second.
pub const PS_PER_S: f64 = 1e12;

/// A point in (or span of) simulated time, in picoseconds. `u64` picoseconds cover 213 days.
pub type SimTime = u64;

/// Converts seconds to picoseconds, rounding to nearest. Negative or NaN input is a bug.
pub fn ps_from_s(seconds: f64) -> SimTime {
    assert!(
        seconds >= 0.0 && seconds.is_finite(),
        "negative or non-finite duration {seconds}"
    );
    let ps = (seconds * PS_PER_S).round();
    assert!(
        ps < u64::MAX as f64,
        "duration {seconds} s overflows SimTime"
    );
    ps as SimTime
}

/// Converts picoseconds to seconds.
pub fn s_from_ps(ps: SimTime) -> f64 {
    ps as f64 / PS_PER_S
}
