//! presets (placeholder)
