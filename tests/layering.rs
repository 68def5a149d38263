//! The house's rules as tests: every import in `src/` points down the layer order that
//! docs/design.md declares ("Layers"), and no files import each other in a circle; one name
//! means one module (no two files of `src/` name a module alike); a `mod.rs` only declares and
//! re-exports, its module's types live in files named for them.
//!
//! An import is a `crate::MODULE` or `super::` path in code (comments and `#[cfg(test)]`
//! modules are not imports: unit tests may reach anywhere). A path resolves to the deepest file
//! of `src/` it names; `crate::Error` and the other names `lib.rs` re-exports resolve to the
//! module they come from.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use common::source::{blanked, files, without_tests};

/// The declared layers, top first, from docs/design.md's fenced `layers` block.
fn declared_layers(root: &Path) -> Vec<Vec<String>> {
    let doc = fs::read_to_string(root.join("docs/design.md")).expect("docs/design.md");
    let block = doc
        .split("```layers\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("docs/design.md declares the layers in a ```layers block");
    block
        .lines()
        .map(|l| l.split('#').next().unwrap_or("").split_whitespace())
        .map(|words| words.map(str::to_owned).collect::<Vec<_>>())
        .filter(|layer| !layer.is_empty())
        .collect()
}

/// The code of a file without comments, string literals and `#[cfg(test)]` items.
fn code(text: &str) -> String {
    without_tests(&blanked(text))
}

/// The module path of a source file: `src/pool/host/mod.rs` -> `["pool", "host"]`.
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).expect("under src");
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_owned())
        .collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    parts
}

/// The paths a file's code names: each `crate::a::b..` or `super::..::a..` as absolute module
/// paths (as many segments as follow; resolution to a file comes later). `use` groups
/// (`crate::a::{b, c::d}`) name each member.
fn named_paths(module: &[String], code: &str) -> Vec<Vec<String>> {
    let mut found = Vec::new();
    let bytes = code.as_bytes();
    for (at, _) in code
        .match_indices("crate::")
        .chain(code.match_indices("super::"))
    {
        if at > 0 && (bytes[at - 1].is_ascii_alphanumeric() || bytes[at - 1] == b'_') {
            continue;
        }
        if code[..at].ends_with("::") {
            continue; // the tail of a longer path (`super::super::x`), read from its start
        }
        let mut base: Vec<String> = Vec::new();
        let mut rest = &code[at..];
        if let Some(r) = rest.strip_prefix("crate::") {
            rest = r;
        } else {
            // `super` is the parent of the file's module (a `mod.rs` is its folder's module).
            base = module.to_vec();
            while let Some(r) = rest.strip_prefix("super::") {
                base.pop();
                rest = r;
            }
        }
        expand(base, rest, &mut found);
    }
    found
}

/// Appends the path(s) `rest` names below `base`, a group `{..}` naming each member.
fn expand(mut base: Vec<String>, mut rest: &str, found: &mut Vec<Vec<String>>) {
    loop {
        let ident: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if !ident.is_empty() {
            base.push(ident.clone());
            rest = &rest[ident.len()..];
            if let Some(r) = rest.strip_prefix("::") {
                rest = r;
                continue;
            }
            found.push(base);
            return;
        }
        if let Some(r) = rest.strip_prefix('{') {
            let mut depth = 1;
            let mut end = 0;
            for (k, c) in r.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            end = k;
                            break;
                        }
                    }
                    _ => {}
                }
            }
            let inner = &r[..end];
            let mut depth = 0;
            let mut start = 0;
            for (k, c) in inner.char_indices().chain([(inner.len(), ',')]) {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        let member = inner[start..k].trim();
                        if !member.is_empty() && member != "self" {
                            expand(base.clone(), member, found);
                        } else if member == "self" {
                            found.push(base.clone());
                        }
                        start = k + 1;
                    }
                    _ => {}
                }
            }
        } else if !base.is_empty() {
            found.push(base);
        }
        return;
    }
}

/// The deepest file of `files` (by module path) that `path` names, if any.
fn resolve(files: &BTreeMap<Vec<String>, PathBuf>, path: &[String]) -> Option<Vec<String>> {
    (1..=path.len())
        .rev()
        .map(|n| path[..n].to_vec())
        .find(|p| files.contains_key(p))
}

#[test]
fn imports_point_down_the_declared_layers_and_no_files_form_a_circle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let src = root.join("src");
    let layers = declared_layers(root);
    let top = layers.len();
    let layer_of: BTreeMap<&str, usize> = layers
        .iter()
        .enumerate()
        .flat_map(|(i, layer)| layer.iter().map(move |m| (m.as_str(), top - i)))
        .collect();

    let paths = files(&src, ".rs");
    let files: BTreeMap<Vec<String>, PathBuf> = paths
        .iter()
        .map(|p| (module_of(&src, p), p.clone()))
        .collect();
    // The root's re-exports name the module they come from.
    let lib = code(&fs::read_to_string(src.join("lib.rs")).expect("lib.rs"));
    let mut reexports: BTreeMap<String, String> = BTreeMap::new();
    for line in lib
        .lines()
        .filter_map(|l| l.trim().strip_prefix("pub use "))
    {
        let (module, names) = line.split_once("::").expect("pub use module::names");
        for name in names.trim_matches(|c| "{};".contains(c)).split(',') {
            reexports.insert(name.trim().to_owned(), module.to_owned());
        }
    }

    let mut wrong = Vec::new();
    let mut edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    for (module, file) in &files {
        let Some(top) = module.first() else { continue }; // lib.rs declares the modules
        let text = code(&fs::read_to_string(file).expect("readable source"));
        for mut path in named_paths(module, &text) {
            if let Some(home) = path.first().and_then(|n| reexports.get(n)) {
                path = vec![home.clone()];
            }
            let Some(target) = resolve(&files, &path) else {
                continue;
            };
            let Some(to) = target.first() else { continue };
            if to != top {
                let (Some(&from_layer), Some(&to_layer)) =
                    (layer_of.get(top.as_str()), layer_of.get(to.as_str()))
                else {
                    wrong.push(format!(
                        "{}: module `{top}` or `{to}` is in no layer of docs/design.md",
                        file.display()
                    ));
                    continue;
                };
                if to_layer >= from_layer {
                    wrong.push(format!(
                        "{}: imports `{}` (layer {to_layer}) from layer {from_layer}",
                        file.display(),
                        path.join("::")
                    ));
                }
            }
            if &target != module {
                edges.entry(module.clone()).or_default().insert(target);
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports against the layers:\n{}",
        wrong.join("\n")
    );

    // Circles between files: a depth-first search that meets a file on its own stack.
    fn visit(
        at: &Vec<String>,
        edges: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        state: &mut BTreeMap<Vec<String>, u8>,
        stack: &mut Vec<Vec<String>>,
    ) -> Option<Vec<Vec<String>>> {
        state.insert(at.clone(), 1);
        stack.push(at.clone());
        for next in edges.get(at).into_iter().flatten() {
            match state.get(next) {
                Some(1) => {
                    let from = stack.iter().position(|m| m == next).unwrap_or(0);
                    return Some(stack[from..].to_vec());
                }
                Some(_) => {}
                None => {
                    if let Some(circle) = visit(next, edges, state, stack) {
                        return Some(circle);
                    }
                }
            }
        }
        stack.pop();
        state.insert(at.clone(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for module in files.keys() {
        if !state.contains_key(module) {
            if let Some(circle) = visit(module, &edges, &mut state, &mut Vec::new()) {
                let names: Vec<String> = circle.iter().map(|m| m.join("::")).collect();
                panic!(
                    "files import each other in a circle: {}",
                    names.join(" -> ")
                );
            }
        }
    }
}

/// The name each file gives its module: the file's stem, or its folder's for a `mod.rs`.
fn module_name(file: &Path) -> String {
    let stem = file.file_stem().map(|s| s.to_string_lossy().into_owned());
    match stem.as_deref() {
        Some("mod") => file
            .parent()
            .and_then(Path::file_name)
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default(),
        _ => stem.unwrap_or_default(),
    }
}

#[test]
fn no_two_modules_of_src_share_a_name() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let paths = files(&src, ".rs");
    let mut by_name: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for file in paths.iter().filter(|p| !p.ends_with("lib.rs")) {
        let rel = file.strip_prefix(&src).expect("under src");
        by_name
            .entry(module_name(file))
            .or_default()
            .push(rel.display().to_string());
    }
    let clashes: Vec<String> = by_name
        .iter()
        .filter(|(_, files)| files.len() > 1)
        .map(|(name, files)| format!("`{name}`: {}", files.join(", ")))
        .collect();
    assert!(
        clashes.is_empty(),
        "one name, one meaning: these modules of src/ share a name (name each file for its job):\n{}",
        clashes.join("\n")
    );
}

/// Most lines of code (not comments or blank) a `mod.rs` may hold: its declarations and
/// re-exports.
const MOD_RS_CODE_LINES: usize = 60;

#[test]
fn every_mod_rs_only_declares_and_re_exports() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let paths = files(&src, ".rs");
    let mut wrong = Vec::new();
    for file in paths.iter().filter(|p| p.ends_with("mod.rs")) {
        let text = code(&fs::read_to_string(file).expect("readable source"));
        let lines = text.lines().filter(|l| !l.trim().is_empty()).count();
        if lines > MOD_RS_CODE_LINES {
            wrong.push(format!(
                "{}: {lines} lines of code (at most {MOD_RS_CODE_LINES}: declarations and re-exports)",
                file.display()
            ));
        }
        for word in text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
            if matches!(
                word,
                "struct" | "enum" | "trait" | "union" | "fn" | "impl" | "type" | "macro_rules"
            ) {
                wrong.push(format!(
                    "{}: defines a `{word}` (move it to a file named for it)",
                    file.display()
                ));
                break;
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "a mod.rs declares its files and re-exports their items, nothing more:\n{}",
        wrong.join("\n")
    );
}
