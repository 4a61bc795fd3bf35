//! report_json (placeholder)
