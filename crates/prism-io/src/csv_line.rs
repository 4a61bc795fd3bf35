//! The simple CSV of the kernel-time and distribution tables: comma-separated fields,
//! optionally double-quoted with `""` for a quote inside; blank lines and `#` lines are
//! comments. Hand-written rather than the `csv` crate on purpose: the crate reads malformed
//! quoting (`"a"x`, `a"b`, an unclosed quote) without an error, and these readers must name the
//! line and the rule a bad file breaks.

/// The data lines of `text` (not blank, not a `#` comment) with their 1-based numbers, split
/// into fields.
pub(crate) fn rows(text: &str) -> impl Iterator<Item = (usize, Result<Vec<String>, String>)> + '_ {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    text.lines().enumerate().filter_map(|(idx, raw)| {
        let raw = raw.strip_suffix('\r').unwrap_or(raw);
        let trimmed = raw.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            None
        } else {
            Some((idx + 1, split_fields(raw)))
        }
    })
}

/// `field` as written in a table: quoted when it would otherwise not read back the same
/// (a separator, quote or line break, outer blanks, empty, or a `#` that could start a comment).
pub(crate) fn quote(field: &str) -> String {
    if field.contains([',', '"', '\n', '\r', '#']) || field.trim() != field || field.is_empty() {
        format!("\"{}\"", field.replace('"', "\"\""))
    } else {
        field.to_owned()
    }
}

/// Splits one CSV line into fields; unquoted fields are trimmed.
pub(crate) fn split_fields(line: &str) -> Result<Vec<String>, String> {
    let mut fields = Vec::new();
    let mut chars = line.chars().peekable();
    loop {
        // Skip leading blanks of the field.
        while chars.peek().is_some_and(|c| *c == ' ' || *c == '\t') {
            chars.next();
        }
        let mut field = String::new();
        if chars.peek() == Some(&'"') {
            chars.next();
            loop {
                match chars.next() {
                    Some('"') if chars.peek() == Some(&'"') => {
                        chars.next();
                        field.push('"');
                    }
                    Some('"') => break,
                    Some(c) => field.push(c),
                    None => return Err(format!("unterminated quoted field {}", fields.len() + 1)),
                }
            }
            while chars.peek().is_some_and(|c| *c == ' ' || *c == '\t') {
                chars.next();
            }
            match chars.next() {
                None => {
                    fields.push(field);
                    return Ok(fields);
                }
                Some(',') => fields.push(field),
                Some(c) => {
                    return Err(format!(
                        "unexpected {c:?} after the closing quote of field {}",
                        fields.len() + 1
                    ));
                }
            }
        } else {
            loop {
                match chars.next() {
                    None => {
                        fields.push(field.trim().to_owned());
                        return Ok(fields);
                    }
                    Some(',') => break,
                    Some('"') => {
                        return Err(format!(
                            "stray quote in unquoted field {} (quote the whole field and double \
                             inner quotes)",
                            fields.len() + 1
                        ));
                    }
                    Some(c) => field.push(c),
                }
            }
            fields.push(field.trim().to_owned());
        }
    }
}
