//! The repository's own sources, read for the house rules' tests (tests/layering.rs,
//! tests/house.rs): the files under a folder, their code without comments and literals (line
//! numbers kept), its `#[cfg(test)]` items left out, and the functions in it.

use std::fs;
use std::path::{Path, PathBuf};

/// The repository's root (the library's manifest folder).
pub fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Every file under `dir` whose name ends in `ext`, sorted.
pub fn files(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for entry in fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.to_string_lossy().ends_with(ext) {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// Rust code with its comments, string literals and char literals blanked (a string becomes
/// `""`); every newline is kept, so line numbers hold.
pub fn blanked(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let newlines = |s: &str| "\n".repeat(s.matches('\n').count());
    let mut i = 0;
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            let end = text[i..].find("*/").map_or(b.len(), |e| i + e + 2);
            out.push_str(&newlines(&text[i..end]));
            i = end;
        } else if b[i] == b'"' {
            let start = i;
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
            out.push_str(&newlines(&text[start..i.min(b.len())]));
        } else if b[i] == b'\'' && b.get(i + 1) == Some(&b'\\') {
            // An escaped char literal ('\n', '\''): up to its closing quote.
            i = text[i + 2..].find('\'').map_or(b.len(), |e| i + 2 + e + 1);
            out.push_str("' '");
        } else if b[i] == b'\'' && b.get(i + 2) == Some(&b'\'') {
            i += 3;
            out.push_str("' '");
        } else {
            // A lifetime's quote, or any other character.
            let c = text[i..].chars().next().expect("a character");
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

/// `code` (blanked) without its `#[cfg(test)]` items: each up to its first `;` or its
/// matching closing brace, replaced by its newlines.
pub fn without_tests(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let item = &rest[at..];
        let mut depth = 0usize;
        let mut end = item.len();
        for (k, c) in item.char_indices() {
            match c {
                ';' if depth == 0 => {
                    end = k + 1;
                    break;
                }
                '{' => depth += 1,
                '}' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        end = k + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        out.push_str(&"\n".repeat(item[..end].matches('\n').count()));
        rest = &item[end..];
    }
    out.push_str(rest);
    out
}

/// A function with a body.
#[derive(Debug)]
pub struct Function {
    /// Its name.
    pub name: String,
    /// Whether it is declared `pub` (exactly: not `pub(crate)` or `pub(super)`).
    pub public: bool,
    /// Its first line, from 1.
    pub line: usize,
    /// Lines from its `fn` to its closing brace.
    pub lines: usize,
    /// Its body, braces included.
    pub body: String,
}

/// The functions with a body in `code` (blanked): every `fn NAME`, its body the braces after
/// its signature (a `;` first: a declaration, left out).
pub fn functions(code: &str) -> Vec<Function> {
    let b = code.as_bytes();
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(found) = code[from..].find("fn ") {
        let at = from + found;
        from = at + 3;
        let word_start = at == 0 || !(b[at - 1].is_ascii_alphanumeric() || b[at - 1] == b'_');
        let name: String = code[at + 3..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if !word_start || name.is_empty() {
            continue;
        }
        // The signature ends at the first `{` or `;` outside parentheses and brackets.
        let mut depth = 0i32;
        let mut open = None;
        for (k, c) in code[at..].char_indices() {
            match c {
                '(' | '[' => depth += 1,
                ')' | ']' => depth -= 1,
                '{' if depth == 0 => {
                    open = Some(at + k);
                    break;
                }
                ';' if depth == 0 => break,
                _ => {}
            }
        }
        let Some(open) = open else { continue };
        let mut braces = 0usize;
        let mut close = code.len();
        for (k, c) in code[open..].char_indices() {
            match c {
                '{' => braces += 1,
                '}' => {
                    braces -= 1;
                    if braces == 0 {
                        close = open + k;
                        break;
                    }
                }
                _ => {}
            }
        }
        let line_start = code[..at].rfind('\n').map_or(0, |n| n + 1);
        let line = code[..at].matches('\n').count() + 1;
        let lines = code[at..close].matches('\n').count() + 1;
        out.push(Function {
            public: code[line_start..at].trim_start().starts_with("pub "),
            name,
            line,
            lines,
            body: code[open..close.min(code.len())].to_owned(),
        });
    }
    out
}

/// The Python functions of `text`: (name, first line, lines), a function running to its last
/// line indented deeper than its `def`.
pub fn python_functions(text: &str) -> Vec<(String, usize, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let indent = |l: &str| l.len() - l.trim_start().len();
    let mut out = Vec::new();
    for (k, line) in lines.iter().enumerate() {
        let body = line.trim_start();
        let Some(def) = body
            .strip_prefix("def ")
            .or_else(|| body.strip_prefix("async def "))
        else {
            continue;
        };
        let name: String = def
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let mut last = k;
        for (q, l) in lines.iter().enumerate().skip(k + 1) {
            if l.trim().is_empty() {
                continue;
            }
            if indent(l) <= indent(line) && !l.trim_start().starts_with(')') {
                break;
            }
            last = q;
        }
        out.push((name, k + 1, last - k + 1));
    }
    out
}
