//! Every relative link of README.md and docs/*.md points to a file or folder that exists, and
//! every `#anchor` to a heading of its target (GitHub's rule: lower case, punctuation dropped,
//! spaces as hyphens, `-1`, `-2`... for repeats). Links inside fenced code blocks are code, not
//! links; web addresses are not checked here.

use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};

/// The markdown files the test reads: the README and every file of docs/.
fn documents(root: &Path) -> Vec<PathBuf> {
    let mut files = vec![root.join("README.md")];
    let mut docs: Vec<PathBuf> = fs::read_dir(root.join("docs"))
        .expect("docs/")
        .map(|e| e.expect("a docs/ entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

/// The lines of `text` outside fenced code blocks.
fn prose(text: &str) -> Vec<&str> {
    let mut fenced = false;
    text.lines()
        .filter(|line| {
            if line.trim_start().starts_with("```") {
                fenced = !fenced;
                return false;
            }
            !fenced
        })
        .collect()
}

/// GitHub's anchor of a heading's text.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a markdown file's headings.
fn anchors(text: &str) -> HashSet<String> {
    let mut seen = HashSet::new();
    for line in prose(text) {
        let Some(heading) = line.strip_prefix('#') else {
            continue;
        };
        let base = slug(heading.trim_start_matches('#'));
        let mut anchor = base.clone();
        let mut n = 0;
        while seen.contains(&anchor) {
            n += 1;
            anchor = format!("{base}-{n}");
        }
        seen.insert(anchor);
    }
    seen
}

/// The targets of the inline links `[text](target)` of a line.
fn links(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        let Some(end) = after.find(')') else {
            break;
        };
        // A target ends at its first space (a link title may follow).
        let target = after[..end].split_whitespace().next().unwrap_or("");
        out.push(target.to_string());
        rest = &after[end..];
    }
    out
}

#[test]
fn every_relative_link_of_the_readme_and_docs_resolves() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut broken = Vec::new();
    let mut checked = 0;
    for file in documents(root) {
        let text = fs::read_to_string(&file).expect("a markdown file");
        let dir = file.parent().expect("the file's folder");
        for line in prose(&text) {
            for target in links(line) {
                if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                checked += 1;
                let (path, anchor) = match target.split_once('#') {
                    Some((path, anchor)) => (path, Some(anchor)),
                    None => (target.as_str(), None),
                };
                let resolved = if path.is_empty() {
                    file.clone()
                } else {
                    dir.join(path)
                };
                let name = file
                    .strip_prefix(root)
                    .unwrap_or(&file)
                    .display()
                    .to_string();
                if !resolved.exists() {
                    broken.push(format!("{name}: {target}: no such file"));
                    continue;
                }
                if let Some(anchor) = anchor {
                    let is_markdown = resolved.extension().is_some_and(|e| e == "md");
                    let target_text = fs::read_to_string(&resolved).unwrap_or_default();
                    if is_markdown && !anchors(&target_text).contains(anchor) {
                        broken.push(format!("{name}: {target}: no such heading"));
                    }
                }
            }
        }
    }
    assert!(
        checked > 20,
        "only {checked} relative links found: is the parser right?"
    );
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn anchors_follow_githubs_rule() {
    let text = "# kvshard\n## P/D across processes\n## Capacity planning (`kvshard plan`)\n\
                ## Dependencies and why (the long version)\n## Layers\n## Layers\n\
                ```sh\n# not a heading\n```\n";
    let got = anchors(text);
    for want in [
        "kvshard",
        "pd-across-processes",
        "capacity-planning-kvshard-plan",
        "dependencies-and-why-the-long-version",
        "layers",
        "layers-1",
    ] {
        assert!(got.contains(want), "{want} in {got:?}");
    }
    assert!(!got.contains("not-a-heading"), "{got:?}");
    assert_eq!(
        links("see [a](docs/a.md#x) and [b](b.md \"title\")."),
        vec!["docs/a.md#x", "b.md"]
    );
}
