//! Reading input files with a size limit, so that a wrong path (a device, a huge file) is an
//! error instead of an out-of-memory.

use std::io::Read;
use std::path::Path;

/// Largest job file, HF config or case file read, bytes; anything larger is rejected unread.
pub(crate) const MAX_FILE_BYTES: u64 = 16 << 20;

/// Reads a regular file of at most [`MAX_FILE_BYTES`] as UTF-8.
pub(crate) fn read_limited(path: &Path) -> Result<String, String> {
    let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let meta = file.metadata().map_err(|e| e.to_string())?;
    if !meta.is_file() {
        return Err("not a regular file".into());
    }
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(format!("larger than the {MAX_FILE_BYTES}-byte limit"));
    }
    String::from_utf8(bytes).map_err(|_| "not valid UTF-8".to_string())
}
