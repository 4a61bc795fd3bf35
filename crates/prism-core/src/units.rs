//! Simulated time. The engine counts integer picoseconds so that event order and every reported
//! number are exact and reproducible.

/// Picoseconds per second.
pub const PS_PER_S: f64 = 1e12;

/// Bytes in a GiB.
pub const GIB: f64 = (1u64 << 30) as f64;

/// A point in (or span of) simulated time, in picoseconds. `u64` picoseconds cover 213 days.
pub type SimTime = u64;

/// The longest simulated time the engine represents: 2^61 ps, about 26.7 days. A duration
/// beyond it is held at it ([`ps_from_s`]), and the engine refuses an iteration that reaches it
/// (`SimError::TooLong`), so that the sum of a few such times never overflows `u64`.
pub const TIME_LIMIT: SimTime = 1 << 61;

/// Converts seconds to picoseconds, rounding to nearest and holding at [`TIME_LIMIT`].
/// Negative or NaN input is a bug.
pub fn ps_from_s(seconds: f64) -> SimTime {
    assert!(
        seconds >= 0.0 && !seconds.is_nan(),
        "negative or NaN duration {seconds}"
    );
    let ps = (seconds * PS_PER_S).round();
    if ps >= TIME_LIMIT as f64 {
        TIME_LIMIT
    } else {
        ps as SimTime
    }
}

/// Converts picoseconds to seconds.
pub fn s_from_ps(ps: SimTime) -> f64 {
    ps as f64 / PS_PER_S
}
