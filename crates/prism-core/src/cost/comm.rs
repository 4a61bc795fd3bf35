//! comm
