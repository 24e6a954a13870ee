//! `cargo xtask docs`: the recorded outputs in README.md and docs/ come from a real run.
//!
//! A recorded output is a ```` ```text ```` block right after a marker line naming the parts of
//! the demo's transcript it shows, in order:
//!
//! ```text
//! <!-- recorded: plan run-once -->
//! ```
//!
//! The part `on-node` stands for the output of the ```` ```sh ```` block just above: its
//! commands (without their `kubectl exec` prefix) run in one shell on the demo's `demo-local`
//! node once its agent is ready, with that node's bpffs at `/sys/fs/bpf` and its state at
//! `/run/node-agent`, where a DaemonSet's pod sees them. `on-node without=worker-b,worker-c`
//! runs them against the node list less those nodes (`node-agent plan` then shows what the agent
//! would do if they went away).
//!
//! `cargo xtask docs` runs the demo (a sandbox; see `demo.rs`) and writes each marked block anew
//! from what it printed. `cargo xtask docs --check`, a step of `cargo xtask test`, runs it and
//! fails naming every block that differs from the run in more than what changes from run to run
//! ([`normalize`]).

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

use crate::cmd::{root, step};
use crate::demo::{self, OnNode, PARTS, Transcript};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Change nothing; fail if a recorded output is stale.
    #[arg(long)]
    pub check: bool,
}

const MARKER: &str = "<!-- recorded: ";
/// The part that is the output of the commands of the `sh` block above the marker.
const ON_NODE: &str = "on-node";
/// What the docs put before a command that runs in the agent's pod.
const EXEC: &str = "kubectl -n node-agent exec ds/node-agent -- ";

pub fn run(args: &Args) -> anyhow::Result<()> {
    let files = documents()?;
    // Before the run: a marker that names no part fails at once.
    for f in &files {
        let text = std::fs::read_to_string(f)?;
        blocks(&text).with_context(|| shown(f))?;
    }
    let mut scripts = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f)?;
        scripts.extend(blocks(&text)?.into_iter().filter_map(|b| b.script));
    }
    let transcript = demo::run(&scripts)?;
    let lookup = |b: &Block| content(&transcript, b);
    let mut stale = Vec::new();
    let mut count = 0;
    for f in &files {
        let text = std::fs::read_to_string(f)?;
        let filled = fill(&text, &lookup).with_context(|| shown(f))?;
        count += blocks(&text)?.len();
        for (parts, old, new) in differences(&text, &filled)? {
            stale.push(format!("{} `{parts}`:\n{}", shown(f), diff(&old, &new)));
        }
        if !args.check && filled != text {
            std::fs::write(f, &filled)?;
        }
    }
    match (args.check, stale.is_empty()) {
        (true, false) => bail!(
            "{} of {count} recorded outputs are stale; `cargo xtask docs` writes them from a \
             fresh run:\n{}",
            stale.len(),
            stale.join("\n")
        ),
        (true, true) => step(&format!(
            "docs: {count} recorded outputs in {} files match a fresh demo run",
            files.len()
        )),
        (false, _) => step(&format!(
            "docs: {count} recorded outputs written from a fresh demo run ({} had changed)",
            stale.len()
        )),
    }
    Ok(())
}

/// What the demo printed for a block's parts.
fn content(t: &Transcript, b: &Block) -> anyhow::Result<String> {
    if let Some(script) = &b.script {
        return t
            .on_node(script)
            .map(str::to_owned)
            .with_context(|| format!("the demo did not run `{}`", script.commands));
    }
    b.parts
        .iter()
        .map(|p| {
            t.part(p)
                .map(str::to_owned)
                .with_context(|| format!("the demo printed nothing for `{p}`"))
        })
        .collect()
}

/// README.md and every `docs/*.md`.
fn documents() -> anyhow::Result<Vec<PathBuf>> {
    let mut files = vec![root().join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    docs.retain(|p| p.extension().is_some_and(|e| e == "md"));
    docs.sort();
    files.extend(docs);
    Ok(files)
}

fn shown(p: &Path) -> String {
    p.strip_prefix(root()).unwrap_or(p).display().to_string()
}

/// A marked block: the parts it shows and the line range of its content (after the opening
/// fence, before the closing one).
#[derive(Debug, PartialEq)]
struct Block {
    parts: Vec<String>,
    /// For `on-node`: the commands of the `sh` block above, and the list they see.
    script: Option<OnNode>,
    content: std::ops::Range<usize>,
}

/// Every marked block of a document, checked: each marker names known parts and is followed by
/// a ```` ```text ```` block.
fn blocks(text: &str) -> anyhow::Result<Vec<Block>> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(rest) = line.trim().strip_prefix(MARKER) else {
            continue;
        };
        let Some(list) = rest.strip_suffix("-->") else {
            bail!("line {}: a marker ends with `-->`", i + 1);
        };
        let parts: Vec<String> = list.split_whitespace().map(str::to_owned).collect();
        if parts.is_empty() {
            bail!("line {}: the marker names no part", i + 1);
        }
        let script = if parts[0] == ON_NODE {
            let mut without = Vec::new();
            for option in &parts[1..] {
                match option.strip_prefix("without=") {
                    Some(nodes) => without.extend(nodes.split(',').map(str::to_owned)),
                    None => bail!(
                        "line {}: `{ON_NODE}` takes only `without=NODE,...`, not `{option}`",
                        i + 1
                    ),
                }
            }
            let commands = script_above(&lines[..i]).with_context(|| format!("line {}", i + 1))?;
            Some(OnNode { commands, without })
        } else {
            if let Some(p) = parts.iter().find(|p| !PARTS.contains(&p.as_str())) {
                bail!(
                    "line {}: the demo records no part `{p}` (it records {}, and `{ON_NODE}` \
                     first runs the sh block above)",
                    i + 1,
                    PARTS.join(", ")
                );
            }
            None
        };
        if lines.get(i + 1).map(|l| l.trim()) != Some("```text") {
            bail!(
                "line {}: a marker must be followed by a ```text block",
                i + 1
            );
        }
        let Some(end) = lines[i + 2..].iter().position(|l| l.trim() == "```") else {
            bail!("line {}: the ```text block is never closed", i + 2);
        };
        out.push(Block {
            parts,
            script,
            content: i + 2..i + 2 + end,
        });
    }
    Ok(out)
}

/// The commands of the ```` ```sh ```` block that ends right above (blank lines between), the
/// `kubectl exec` prefix taken off.
fn script_above(lines: &[&str]) -> anyhow::Result<String> {
    let mut end = lines.len();
    while end > 0 && lines[end - 1].trim().is_empty() {
        end -= 1;
    }
    if end == 0 || lines[end - 1].trim() != "```" {
        bail!("`{ON_NODE}` needs a ```sh block right above it");
    }
    let Some(start) = lines[..end - 1].iter().rposition(|l| l.trim() == "```sh") else {
        bail!("`{ON_NODE}` needs a ```sh block right above it");
    };
    let commands: Vec<&str> = lines[start + 1..end - 1]
        .iter()
        .filter_map(|l| l.strip_prefix("$ "))
        .map(|c| c.strip_prefix(EXEC).unwrap_or(c))
        .collect();
    if commands.is_empty() {
        bail!("the ```sh block above has no `$ ` command");
    }
    Ok(commands.join("\n"))
}

/// `text` with every marked block's content replaced by what `lookup` gives for it.
fn fill(text: &str, lookup: &dyn Fn(&Block) -> anyhow::Result<String>) -> anyhow::Result<String> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = String::new();
    let mut at = 0;
    for b in blocks(text)? {
        for l in &lines[at..b.content.start] {
            out += l;
            out.push('\n');
        }
        out += &lookup(&b)?;
        at = b.content.end;
    }
    for l in &lines[at..] {
        out += l;
        out.push('\n');
    }
    Ok(out)
}

/// The blocks of `old` whose content differs from `new`'s beyond [`normalize`]: (parts, old,
/// new).
fn differences(old: &str, new: &str) -> anyhow::Result<Vec<(String, String, String)>> {
    let content = |text: &str, b: &Block| -> String {
        text.lines().collect::<Vec<_>>()[b.content.clone()].join("\n")
    };
    let (a, b) = (blocks(old)?, blocks(new)?);
    Ok(a.iter()
        .zip(&b)
        .map(|(x, y)| (x.parts.join(" "), content(old, x), content(new, y)))
        .filter(|(_, x, y)| normalize(x) != normalize(y))
        .collect())
}

/// What stays the same from one run to the next: the lines, sorted (a hash map's dump comes in
/// the order of its buckets, which a map's random seed sets), with times, durations, the
/// sandbox's process ID and moved-aside suffixes masked.
fn normalize(text: &str) -> Vec<String> {
    let mut lines: Vec<String> = text.lines().map(mask).collect();
    lines.sort();
    lines
}

/// One line with what varies between runs masked: `2026-11-28T08:00:35.555083Z`, the digits
/// after `node-agent-demo-`, `elapsed_ms=`, `apply_ms=`, `corrupt-`, `btf_id `, `memlock `
/// (kernels differ), `"confirmable_at_unix": `, `(pid `, `(12s ago)`, and a kernel object ID
/// that starts a line (`42780: hash ...`).
fn mask(line: &str) -> String {
    let id = line.bytes().take_while(u8::is_ascii_digit).count();
    if id > 0 && line[id..].starts_with(": ") {
        return format!("N{}", mask(&line[id..]));
    }
    let mut out = String::new();
    let b = line.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if let Some(n) = timestamp_len(&b[i..]) {
            out += "<time>";
            i += n;
            continue;
        }
        let after = [
            "node-agent-demo-",
            "elapsed_ms=",
            "apply_ms=",
            "corrupt-",
            "btf_id ",
            "memlock ",
            "\"confirmable_at_unix\": ",
            "(pid ",
            "(",
        ]
        .iter()
        .find(|p| b[i..].starts_with(p.as_bytes()));
        if let Some(p) = after {
            let digits = b[i + p.len()..]
                .iter()
                .take_while(|c| c.is_ascii_digit() || **c == b'.')
                .count();
            let ago = *p == "(" && b[i + 1 + digits..].starts_with(b"s ago)");
            if digits > 0 && (*p != "(" || ago) {
                out += p;
                out += "N";
                i += p.len() + digits;
                continue;
            }
        }
        let c = line[i..].chars().next().expect("in bounds");
        out.push(c);
        i += c.len_utf8();
    }
    out
}

/// The length of an RFC 3339 UTC time at the start of `b` (`YYYY-MM-DDTHH:MM:SS[.frac]Z`).
fn timestamp_len(b: &[u8]) -> Option<usize> {
    let shape = b"dddd-dd-ddTdd:dd:dd";
    if b.len() < shape.len() {
        return None;
    }
    for (c, s) in b.iter().zip(shape) {
        let ok = match s {
            b'd' => c.is_ascii_digit(),
            s => c == s,
        };
        if !ok {
            return None;
        }
    }
    let mut n = shape.len();
    if b.get(n) == Some(&b'.') {
        n += 1 + b[n + 1..].iter().take_while(|c| c.is_ascii_digit()).count();
    }
    (b.get(n) == Some(&b'Z')).then_some(n + 1)
}

/// The lines only one side has, for the error.
fn diff(old: &str, new: &str) -> String {
    let (a, b) = (normalize(old), normalize(new));
    let gone = a
        .iter()
        .filter(|l| !b.contains(l))
        .map(|l| format!("- {l}"));
    let came = b
        .iter()
        .filter(|l| !a.contains(l))
        .map(|l| format!("+ {l}"));
    gone.chain(came).collect::<Vec<_>>().join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOC: &str = "# t\n\n<!-- recorded: plan -->\n```text\nold\n```\n\nprose\n\n<!-- recorded: pings pings-after -->\n```text\n```\nend\n";

    fn lookup(b: &Block) -> anyhow::Result<String> {
        Ok(b.parts
            .iter()
            .map(|part| format!("{part} at 2026-11-28T08:00:35.555083Z elapsed_ms=3\n"))
            .collect())
    }

    #[test]
    fn filling_replaces_only_the_marked_blocks() {
        let filled = fill(DOC, &lookup).unwrap();
        assert_eq!(
            filled,
            "# t\n\n<!-- recorded: plan -->\n```text\nplan at 2026-11-28T08:00:35.555083Z elapsed_ms=3\n```\n\nprose\n\n<!-- recorded: pings pings-after -->\n```text\npings at 2026-11-28T08:00:35.555083Z elapsed_ms=3\npings-after at 2026-11-28T08:00:35.555083Z elapsed_ms=3\n```\nend\n"
        );
        assert_eq!(fill(&filled, &lookup).unwrap(), filled, "idempotent");
        assert_eq!(differences(DOC, &filled).unwrap().len(), 2);
        assert!(differences(&filled, &filled).unwrap().is_empty());
    }

    #[test]
    fn what_varies_between_runs_is_not_a_difference_and_the_rest_is() {
        let a = "2026-11-28T08:00:35.555083Z INFO x elapsed_ms=2 apply_ms=1 path=/tmp/node-agent-demo-28052/s\nwritten 2026-11-28T08:00:41Z (0s ago)\nnodes.ckpt.corrupt-1795515559.196071215\nanother node-agent (pid 12364) holds the lock\n";
        let b = "written 2026-11-29T09:10:11Z (12s ago)\n2026-11-29T10:00:00.1Z INFO x elapsed_ms=58 apply_ms=40 path=/tmp/node-agent-demo-7/s\nnodes.ckpt.corrupt-1.2\nanother node-agent (pid 7) holds the lock\n";
        let show = |id: u32, btf: u32| {
            format!(
                "{id}: hash  name NODE_IDS  flags 0x1\n\tkey 20B  memlock {btf}B\n\tbtf_id {btf}\n"
            )
        };
        assert_eq!(normalize(&show(42780, 7)), normalize(&show(3, 73748)));
        assert_ne!(
            normalize(&show(3, 7)),
            normalize(&show(3, 7).replace("NODE_IDS", "POD_CIDRS"))
        );
        assert_eq!(normalize(a), normalize(b));
        for changed in [
            "format v3",
            "node_agent::datapath: attached",
            "(3 nodes)",
            "elapsed_ms=x",
        ] {
            assert_ne!(
                normalize(&format!("{a}{changed}\n")),
                normalize(&format!("{a}{}\n", changed.replace(['3', 'd', 'x'], "4"))),
                "{changed}"
            );
        }
    }

    #[test]
    fn bad_markers_are_refused_naming_their_line() {
        for (doc, why) in [
            (
                "<!-- recorded: nothing-like-it -->\n```text\n```\n",
                "no part",
            ),
            ("<!-- recorded: plan -->\nprose\n", "followed by"),
            ("<!-- recorded: plan -->\n```text\nx\n", "never closed"),
            ("<!-- recorded: -->\n```text\n```\n", "names no part"),
            (
                "prose\n<!-- recorded: on-node -->\n```text\n```\n",
                "sh block",
            ),
            (
                "```sh\n$ ls\n```\n<!-- recorded: on-node plan -->\n```text\n```\n",
                "only `without=",
            ),
            (
                "```sh\n$ ls\n```\n<!-- recorded: plan on-node -->\n```text\n```\n",
                "no part `on-node`",
            ),
        ] {
            let e = format!("{:#}", blocks(doc).unwrap_err());
            assert!(e.contains(why) && e.contains("line "), "{doc}: {e}");
        }
    }

    #[test]
    fn on_node_runs_the_commands_above_without_their_exec_prefix() {
        let doc = "```sh\n$ kubectl -n node-agent exec ds/node-agent -- ls /run/node-agent\n$ ip route show proto 201\n```\n\n<!-- recorded: on-node -->\n```text\nold\n```\n";
        let b = blocks(doc).unwrap();
        assert_eq!(
            b[0].script,
            Some(OnNode {
                commands: "ls /run/node-agent\nip route show proto 201".into(),
                without: vec![]
            })
        );
        let doc = doc.replace("on-node", "on-node without=worker-b,worker-d");
        assert_eq!(
            blocks(&doc).unwrap()[0].script.as_ref().unwrap().without,
            ["worker-b", "worker-d"]
        );
    }

    /// Every marker in the repository's documents is well formed and names parts the demo
    /// records.
    #[test]
    fn every_marker_in_the_docs_names_what_the_demo_records() {
        let mut shown_parts = Vec::new();
        let mut count = 0;
        for f in documents().unwrap() {
            let text = std::fs::read_to_string(&f).unwrap();
            for b in blocks(&text).unwrap_or_else(|e| panic!("{}: {e:#}", shown(&f))) {
                count += 1;
                shown_parts.extend(b.parts);
            }
        }
        let unshown: Vec<&&str> = PARTS
            .iter()
            .filter(|p| !shown_parts.iter().any(|s| s == *p))
            .collect();
        assert!(count > 0, "no recorded block in the docs");
        println!(
            "docs: {count} recorded blocks show {} of the demo's {} parts (not shown: {unshown:?})",
            PARTS.len() - unshown.len(),
            PARTS.len()
        );
    }
}
