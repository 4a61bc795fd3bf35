//! The two CSV dialects Prism reads, both parsed by the `csv` crate.
//!
//! * **Line tables** (kernel-time tables, duration samples, distribution tables): one record per
//!   line; a field may be quoted with `"` (a doubled `""` inside is a literal quote) but a quoted
//!   field does not span lines; blanks around a field are not part of it; blank lines and lines
//!   whose first non-blank character is `#` are comments. [`rows`] reads them and [`TableWriter`]
//!   writes them.
//! * **RFC 4180 records** (`validation/cases.csv`): quoted fields may span lines, nothing is
//!   trimmed, and every field keeps the line and column it starts at. [`split_csv`] reads them.
//!
//! The `csv` crate splits the fields and undoes the quoting. It is lenient where these readers
//! must not be: it reads `"a"x` as `ax`, `a"b` as `a"b` and an unclosed quote as running to the
//! end of the input, all without an error. So each dialect first runs a small check of its own
//! quoting rules, which reports the line (and for RFC 4180 the column) and the rule broken, and
//! hands the crate only text those rules accept. The crate's own record positions are not used
//! for line numbers: a record after blank lines reports the position where the blank lines start.

use csv::{ReaderBuilder, StringRecord, Terminator, WriterBuilder};

// ---------------------------------------------------------------------------------------------
// Line tables
// ---------------------------------------------------------------------------------------------

/// The data lines of a line table with their 1-based numbers, one record each, in file order.
///
/// A line that breaks the quoting rules yields an error naming the rule and ends the sequence,
/// so a caller that stops at its first error reports the first bad line of the file.
pub(crate) fn rows(text: &str) -> Vec<(usize, Result<StringRecord, String>)> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    // The data lines in the strict form the crate reads (see `strict_line`), one per line, and
    // the file line each came from.
    let mut strict = String::with_capacity(text.len());
    let mut line_numbers = Vec::new();
    let mut bad_line = None;
    for (idx, raw) in text.lines().enumerate() {
        let raw = raw.strip_suffix('\r').unwrap_or(raw);
        let trimmed = raw.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        match strict_line(raw, &mut strict) {
            Ok(()) => {
                strict.push('\n');
                line_numbers.push(idx + 1);
            }
            Err(rule) => {
                bad_line = Some((idx + 1, rule));
                break;
            }
        }
    }

    // Only `\n` ends a record: the strict text has one line per data line, and a `\r` that
    // `lines()` left inside a line is data.
    let mut reader = ReaderBuilder::new()
        .has_headers(false)
        .flexible(true)
        .terminator(Terminator::Any(b'\n'))
        .from_reader(strict.as_bytes());
    // A strict line is never empty, so the crate (which skips empty lines) reads exactly one
    // record per entry of `line_numbers`.
    let mut out: Vec<(usize, Result<StringRecord, String>)> = line_numbers
        .into_iter()
        .zip(reader.records())
        .map(|(line, record)| (line, record.map_err(|e| format!("CSV syntax: {e}"))))
        .collect();
    out.extend(bad_line.map(|(line, rule)| (line, Err(rule))));
    out
}

/// Checks the quoting of one line-table line and appends the line to `out` in strict CSV form:
/// every field without the blanks around it, so that a quote opens a quoted field only as the
/// field's first character, as the crate requires. The fields themselves are left as written
/// (quotes and doubled quotes included) for the crate to split and unquote.
///
/// Rules, checked field by field: space and tab before an opening quote and after a closing
/// quote are ignored; a quoted field closes on its line and is followed by `,` or the line end;
/// an unquoted field holds no `"`; an unquoted field is trimmed.
fn strict_line(line: &str, out: &mut String) -> Result<(), String> {
    const BLANKS: [char; 2] = [' ', '\t'];
    let mut rest = line;
    let mut field = 1;
    loop {
        if field > 1 {
            out.push(',');
        }
        let start = rest.trim_start_matches(BLANKS);
        if start.starts_with('"') {
            let len =
                quoted_len(start).ok_or_else(|| format!("unterminated quoted field {field}"))?;
            out.push_str(&start[..len]);
            let after = start[len..].trim_start_matches(BLANKS);
            match after.chars().next() {
                None => return Ok(()),
                Some(',') => rest = &after[1..],
                Some(c) => {
                    return Err(format!(
                        "unexpected {c:?} after the closing quote of field {field}"
                    ));
                }
            }
        } else {
            let (value, next) = match rest.split_once(',') {
                Some((value, next)) => (value, Some(next)),
                None => (rest, None),
            };
            if value.contains('"') {
                return Err(format!(
                    "stray quote in unquoted field {field} (quote the whole field and double \
                     inner quotes)"
                ));
            }
            out.push_str(value.trim());
            match next {
                None => return Ok(()),
                Some(next) => rest = next,
            }
        }
        field += 1;
    }
}

/// Length in bytes of the quoted field at the start of `s` (which starts with `"`), closing
/// quote included; `None` when the quote is not closed.
fn quoted_len(s: &str) -> Option<usize> {
    let bytes = s.as_bytes();
    let mut i = 1;
    while i < bytes.len() {
        if bytes[i] == b'"' {
            if bytes.get(i + 1) == Some(&b'"') {
                i += 2;
                continue;
            }
            return Some(i + 1);
        }
        i += 1;
    }
    None
}

/// Writes line tables with the `csv` crate: a field is quoted when it holds a separator, quote,
/// line break or `#` (which could otherwise start a comment line), and a whole record is quoted
/// when one of its fields has outer blanks (which the reader would trim from an unquoted
/// field). What it writes, [`rows`] reads back field for field, except a field holding a `\n`
/// (a quoted field does not span lines, so the reader rejects it).
#[derive(Debug)]
pub(crate) struct TableWriter {
    out: Vec<u8>,
    /// Quotes a field only where needed.
    plain: WriterBuilder,
    /// Quotes every field.
    padded: WriterBuilder,
}

impl TableWriter {
    pub(crate) fn new() -> Self {
        let builder = |style| {
            let mut b = WriterBuilder::new();
            // One writer per record, hence a small buffer (a longer record is written in parts).
            b.comment(Some(b'#'))
                .quote_style(style)
                .buffer_capacity(256);
            b
        };
        TableWriter {
            out: Vec::new(),
            plain: builder(csv::QuoteStyle::Necessary),
            padded: builder(csv::QuoteStyle::Always),
        }
    }

    /// Appends one record.
    pub(crate) fn record(&mut self, fields: &[&str]) {
        let builder = if fields.iter().any(|f| f.trim() != *f) {
            &self.padded
        } else {
            &self.plain
        };
        let mut writer = builder.from_writer(&mut self.out);
        // Writing to memory does not fail.
        let _ = writer.write_record(fields);
        let _ = writer.flush();
    }

    /// Appends a `#` comment line; line breaks in `text` become spaces.
    pub(crate) fn comment(&mut self, text: &str) {
        self.out.extend_from_slice(b"# ");
        self.out
            .extend_from_slice(text.replace(['\n', '\r'], " ").as_bytes());
        self.out.push(b'\n');
    }

    /// The text written.
    pub(crate) fn finish(self) -> String {
        // Every field came in as UTF-8 text.
        String::from_utf8(self.out)
            .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
    }
}

// ---------------------------------------------------------------------------------------------
// RFC 4180 records with positions
// ---------------------------------------------------------------------------------------------

/// One CSV field with the position of its first character.
#[derive(Clone, Debug)]
pub(crate) struct Field {
    pub(crate) text: String,
    pub(crate) line: usize,
    pub(crate) col: usize,
}

/// One CSV record (a row) and the line it starts on.
#[derive(Clone, Debug)]
pub(crate) struct Record {
    pub(crate) line: usize,
    pub(crate) fields: Vec<Field>,
}

/// Splits RFC 4180 CSV text into records. Quoted fields may hold commas, doubled quotes and line
/// breaks; `\r\n`, `\n` and `\r` each end a record; blank lines are not records. Lines and
/// columns are 1-based, columns count characters. Errors carry (line, column, rule).
pub(crate) fn split_csv(text: &str) -> Result<Vec<Record>, (usize, usize, String)> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    check_rfc4180_quoting(text)?;
    let mut reader = ReaderBuilder::new()
        .has_headers(false)
        .flexible(true)
        .from_reader(text.as_bytes());
    let mut cursor = Cursor {
        rest: text,
        line: 1,
        col: 1,
    };
    let mut records = Vec::new();
    for record in reader.records() {
        cursor.skip_line_breaks();
        let record = record.map_err(|e| (cursor.line, cursor.col, format!("CSV syntax: {e}")))?;
        let line = cursor.line;
        let fields = record
            .iter()
            .map(|value| {
                let (line, col) = cursor.pass_field(value);
                Field {
                    text: value.to_owned(),
                    line,
                    col,
                }
            })
            .collect();
        records.push(Record { line, fields });
    }
    // A line holding only `""` is one empty field, as blank as an empty line.
    records.retain(|r| !(r.fields.len() == 1 && r.fields[0].text.is_empty()));
    Ok(records)
}

/// The quoting rules of RFC 4180 that the crate does not enforce: a quote opens a quoted field
/// only as its first character, a quoted field is closed, and its closing quote is followed by
/// `,`, a line end or the end of the text. Errors carry the position of the offending character
/// (of the opening quote for an unclosed field).
fn check_rfc4180_quoting(text: &str) -> Result<(), (usize, usize, String)> {
    let mut chars = text.chars().peekable();
    let (mut line, mut col) = (1usize, 1usize);
    let mut field_start = true;
    while let Some(c) = chars.next() {
        match c {
            '"' if field_start => {
                let (open_line, open_col) = (line, col);
                col += 1;
                loop {
                    match chars.next() {
                        None => {
                            return Err((
                                open_line,
                                open_col,
                                "quoted field is not closed (missing `\"`)".into(),
                            ));
                        }
                        Some('"') if chars.peek() == Some(&'"') => {
                            chars.next();
                            col += 2;
                        }
                        Some('"') => {
                            col += 1;
                            break;
                        }
                        Some('\n') => {
                            line += 1;
                            col = 1;
                        }
                        Some(_) => col += 1,
                    }
                }
                if let Some(&c) = chars.peek().filter(|c| !matches!(c, ',' | '\n' | '\r')) {
                    return Err((
                        line,
                        col,
                        format!(
                            "unexpected `{c}` after a closing quote (expected `,` or a line end)"
                        ),
                    ));
                }
                field_start = false;
            }
            '"' => {
                return Err((
                    line,
                    col,
                    "`\"` inside an unquoted field (quote the whole field and double the `\"`)"
                        .into(),
                ));
            }
            ',' => {
                col += 1;
                field_start = true;
            }
            '\r' | '\n' => {
                if c == '\r' && chars.peek() == Some(&'\n') {
                    chars.next();
                }
                line += 1;
                col = 1;
                field_start = true;
            }
            _ => {
                col += 1;
                field_start = false;
            }
        }
    }
    Ok(())
}

/// Walks the checked source text alongside the crate's records to find where each field starts.
struct Cursor<'a> {
    rest: &'a str,
    line: usize,
    col: usize,
}

impl Cursor<'_> {
    /// Passes the record terminator and any blank lines before the next record.
    fn skip_line_breaks(&mut self) {
        while let Some(rest) = self
            .rest
            .strip_prefix("\r\n")
            .or_else(|| self.rest.strip_prefix(['\n', '\r']))
        {
            self.rest = rest;
            self.line += 1;
            self.col = 1;
        }
    }

    /// Passes the field whose value the crate read as `value`, and the `,` after it; returns
    /// where it starts. In checked text a quoted field is written as its value with every `"`
    /// doubled, between quotes, and an unquoted field as its value.
    fn pass_field(&mut self, value: &str) -> (usize, usize) {
        let start = (self.line, self.col);
        let len = if self.rest.starts_with('"') {
            value.len() + value.matches('"').count() + 2
        } else {
            value.len()
        };
        let raw = self.rest.get(..len).unwrap_or(self.rest);
        for c in raw.chars() {
            // Inside a quoted field only `\n` starts a new line (a lone `\r` is data).
            if c == '\n' {
                self.line += 1;
                self.col = 1;
            } else {
                self.col += 1;
            }
        }
        self.rest = &self.rest[raw.len()..];
        if let Some(rest) = self.rest.strip_prefix(',') {
            self.rest = rest;
            self.col += 1;
        }
        start
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The line-table rows of `text` as plain strings; stops after the first error.
    fn table(text: &str) -> Vec<(usize, Result<Vec<String>, String>)> {
        let mut out = Vec::new();
        for (line, record) in rows(text) {
            let record = record.map(|r| r.iter().map(str::to_owned).collect::<Vec<_>>());
            let stop = record.is_err();
            out.push((line, record));
            if stop {
                break;
            }
        }
        out
    }

    fn fields(v: &[&str]) -> Result<Vec<String>, String> {
        Ok(v.iter().map(|s| s.to_string()).collect())
    }

    /// Why the checks exist: the crate itself reads malformed quoting without an error.
    #[test]
    fn the_crate_alone_is_lenient() {
        let read = |text: &str| -> Vec<Vec<String>> {
            ReaderBuilder::new()
                .has_headers(false)
                .flexible(true)
                .from_reader(text.as_bytes())
                .records()
                .map(|r| r.unwrap().iter().map(str::to_owned).collect())
                .collect()
        };
        assert_eq!(read("\"a\"x,b\n"), [["ax", "b"]]);
        assert_eq!(read("a\"b,c\n"), [["a\"b", "c"]]);
        assert_eq!(read("a,\"b\n"), [["a", "b\n"]]);
    }

    #[test]
    fn tricky_valid_table() {
        let text = "\u{feff}# comment\r\n\
                    op , shape\t,dtype,us\r\n\
                    \r\n\
                    \x20  \t\r\n\
                    \x20  # indented comment, \"with quotes\"\n\
                    \x20\"a,\"\"b\"\"\" \t, 1x2x3 ,\"#bf16\",\" 2.5 \"\n\
                    \"\",,\"\"\"\", x y \n\
                    \"only\"\n\
                    a\rb,\"c\rd\"\r\n\
                    last,line,no,newline";
        assert_eq!(
            table(text),
            [
                (2, fields(&["op", "shape", "dtype", "us"])),
                (6, fields(&["a,\"b\"", "1x2x3", "#bf16", " 2.5 "])),
                (7, fields(&["", "", "\"", "x y"])),
                (8, fields(&["only"])),
                (9, fields(&["a\rb", "c\rd"])),
                (10, fields(&["last", "line", "no", "newline"])),
            ]
        );
        assert!(table("").is_empty());
        assert!(table("\n# only comments\n  \n").is_empty());
    }

    #[test]
    fn malformed_table_quoting_is_an_error_at_its_line() {
        let cases = [
            (
                "h\n\"a\"x,b\n",
                2,
                "unexpected 'x' after the closing quote of field 1",
            ),
            (
                "h\na, \"b\" c\n",
                2,
                "unexpected 'c' after the closing quote of field 2",
            ),
            ("h\na,b\"c\n", 2, "stray quote in unquoted field 2"),
            ("h\n\n\"a,b\n", 3, "unterminated quoted field 1"),
            ("h\na,\"b", 2, "unterminated quoted field 2"),
            // A quoted field does not span lines.
            ("h\n\"a\nb\",c\n", 2, "unterminated quoted field 1"),
        ];
        for (text, line, rule) in cases {
            let rows = table(text);
            let (l, r) = rows.last().unwrap();
            assert_eq!(*l, line, "{text:?}");
            assert!(r.as_ref().unwrap_err().starts_with(rule), "{text:?}: {r:?}");
            // The lines before the bad one are still read, in order.
            assert_eq!(rows[0], (1, fields(&["h"])), "{text:?}");
        }
    }

    #[test]
    fn writer_quotes_what_would_not_read_back() {
        let mut w = TableWriter::new();
        w.record(&["op", "n"]);
        w.record(&["plain", "1"]);
        w.record(&["#3 gemm", "a,b"]);
        w.record(&["say \"hi\"", ""]);
        w.comment("a note\nover two lines");
        w.record(&[" padded", "2"]);
        let text = w.finish();
        assert_eq!(
            text,
            "op,n\nplain,1\n\"#3 gemm\",\"a,b\"\n\"say \"\"hi\"\"\",\n# a note over two lines\n\
             \" padded\",\"2\"\n"
        );
        assert_eq!(
            table(&text),
            [
                (1, fields(&["op", "n"])),
                (2, fields(&["plain", "1"])),
                (3, fields(&["#3 gemm", "a,b"])),
                (4, fields(&["say \"hi\"", ""])),
                (6, fields(&[" padded", "2"])),
            ]
        );
    }

    /// (line, [(text, line, column)]) of every record.
    type Positioned = Vec<(usize, Vec<(String, usize, usize)>)>;

    fn positioned(text: &str) -> Result<Positioned, (usize, usize, String)> {
        Ok(split_csv(text)?
            .into_iter()
            .map(|r| {
                let fields = r.fields.into_iter().map(|f| (f.text, f.line, f.col));
                (r.line, fields.collect())
            })
            .collect())
    }

    #[test]
    fn tricky_valid_rfc4180_positions() {
        let text = "\u{feff}id,\"no\r\nte\",é\r\n\
                    \r\n\
                    \"\"\n\
                    x,\"a\"\"b\rc\",\n\
                    \x20 ,# not a comment\r\
                    \"multi\n\nline\",\"\"";
        let s = |t: &str, l, c| (t.to_string(), l, c);
        assert_eq!(
            positioned(text).unwrap(),
            [
                (1, vec![s("id", 1, 1), s("no\r\nte", 1, 4), s("é", 2, 5)]),
                (5, vec![s("x", 5, 1), s("a\"b\rc", 5, 3), s("", 5, 12)]),
                (6, vec![s("  ", 6, 1), s("# not a comment", 6, 4)]),
                (7, vec![s("multi\n\nline", 7, 1), s("", 9, 7)]),
            ]
        );
        assert!(positioned("").unwrap().is_empty());
        assert!(positioned("\n\r\n\r").unwrap().is_empty());
    }

    #[test]
    fn malformed_rfc4180_quoting_names_line_column_and_rule() {
        let cases = [
            (
                "a,b\n\"c\"x,d\n",
                (2, 4),
                "unexpected `x` after a closing quote",
            ),
            ("a,b\r\nc,d\"e\n", (2, 4), "`\"` inside an unquoted field"),
            ("a, \"b\"\n", (1, 4), "`\"` inside an unquoted field"),
            ("a\n\nb,\"c\nd", (3, 3), "quoted field is not closed"),
            (
                "\"a\nb\" c\n",
                (2, 3),
                "unexpected ` ` after a closing quote",
            ),
        ];
        for (text, (line, col), rule) in cases {
            let (l, c, r) = positioned(text).unwrap_err();
            assert_eq!((l, c), (line, col), "{text:?}: {r}");
            assert!(r.starts_with(rule), "{text:?}: {r}");
        }
    }
}
