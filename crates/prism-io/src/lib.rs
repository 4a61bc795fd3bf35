#![recursion_limit = "256"]
//! # prism-io
//!
//! Prism's edge: everything that reads or writes a format. Job files (TOML) and their presets,
//! HuggingFace `config.json`, measured kernel-time tables (CSV), the JSON summary and the
//! Chrome/Perfetto trace. It converts between those formats and `prism-core` values; the core
//! never sees a file.

mod csv_text;
mod files;
pub mod geo;
pub mod hf;
pub mod jobfile;
pub mod kernel_bench;
pub mod kernel_table;
pub mod kineto;
pub mod megatron_args;
pub mod nemo;
pub mod plot;
pub mod presets;
pub mod report_json;
pub mod resilience;
pub mod samples;
pub mod trace;
pub mod validation;
