//! One line of a simple CSV file (the kernel-time and distribution tables): comma-separated
//! fields, optionally double-quoted with `""` for a quote inside.

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
