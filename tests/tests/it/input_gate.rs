//! The input gate (`state/src/input.rs`), walked as a table: every kind of file at the path of
//! every file the agent reads, each read by the agent's own reader of that file. Each case must
//! end within a bound (no open or read may block), without a panic, and with what the table
//! says: read, or refused with an error naming the file and what was wrong with it. A symlink
//! is followed to the operator's files and refused at the agent's own. The files a kubeconfig
//! names (token, CA bundle, client certificate and key) are read by the Kubernetes client as it
//! is built, from a kubeconfig naming them by paths relative to its directory.

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use node_agent::agent::hold_file;
use node_agent::backends::xfrm::KeyFile;
use node_agent::source::file::parse_file;
use node_agent::source::kube::KubeSource;
use node_agent_tests::report;
use state::checkpoint::{self, Checkpoint, CheckpointStore, LoadOutcome};
use state::input::Input;

/// What can be found at a path.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Regular,
    /// A link to the file: a hostPath or a hand-made link.
    Symlink,
    /// `path -> ..data/name`, `..data -> ..<timestamp>/`: how a Secret or ConfigMap volume
    /// presents its files.
    MountedSecret,
    Fifo,
    SymlinkToFifo,
    Directory,
    CharDevice,
    Socket,
    /// A file one byte over the kind's cap (sparse: no disk is used).
    Oversized,
    /// Nesting far past anything the format holds.
    DeeplyNested,
    /// The valid content cut short.
    Truncated,
}

const KINDS: [Kind; 11] = [
    Kind::Regular,
    Kind::Symlink,
    Kind::MountedSecret,
    Kind::Fifo,
    Kind::SymlinkToFifo,
    Kind::Directory,
    Kind::CharDevice,
    Kind::Socket,
    Kind::Oversized,
    Kind::DeeplyNested,
    Kind::Truncated,
];

/// What the table expects of a case.
#[derive(Debug)]
enum Expect {
    Read,
    /// Refused, the error containing this text (and the file's name).
    Refused(&'static str),
    /// The format has no such case (a flat or binary format cannot nest).
    NotApplicable,
}

/// Where each input sits in a case's directory.
fn path_of(what: Input, dir: &Path) -> PathBuf {
    let state = dir.join("state");
    match what {
        Input::NodeList => dir.join("nodes.yaml"),
        Input::Kubeconfig => dir.join("kubeconfig"),
        Input::Token => dir.join("token"),
        Input::CaBundle => dir.join("ca.crt"),
        Input::ClientCertificate => dir.join("client.crt"),
        Input::ClientKey => dir.join("client.key"),
        // Read only by the in-cluster configuration, at a fixed path: walked by the unit test
        // in `node-agent/src/source/kube.rs`.
        Input::Namespace => dir.join("namespace"),
        Input::Checkpoint => state.join(checkpoint::store::FILE_NAME),
        Input::Lock => state.join("lock"),
        Input::KeyFile => dir.join("ipsec.keys"),
        Input::HoldFile => state.join(hold_file::HOLD_FILE),
        Input::Confirmation => state.join(hold_file::CONFIRM_FILE),
    }
}

const NODES: &str = "apiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: Node\n  metadata: {name: n1}\n  status:\n    addresses: [{type: InternalIP, address: 10.0.0.1}]\n";
const KUBECONFIG: &str = "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {server: 'http://127.0.0.1:1'}\nusers:\n- name: u\n  user: {token: t}\ncontexts:\n- name: x\n  context: {cluster: c, user: u}\ncurrent-context: x\n";
/// A kubeconfig whose cluster and user name their files by paths relative to its directory.
const KUBECONFIG_FILES: &str = "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {server: 'https://127.0.0.1:1', certificate-authority: ca.crt}\nusers:\n- name: u\n  user: {tokenFile: token, client-certificate: client.crt, client-key: client.key}\ncontexts:\n- name: x\n  context: {cluster: c, user: u}\ncurrent-context: x\n";
/// A self-signed P-256 certificate and its key: the CA bundle, and the client's identity.
const CERT: &str = "-----BEGIN CERTIFICATE-----
MIIBjDCCATGgAwIBAgIUIXv8xDzbDyn+dfbz/R8Ib78skKkwCgYIKoZIzj0EAwIw
GjEYMBYGA1UEAwwPbm9kZS1hZ2VudC10ZXN0MCAXDTI2MTEyODE2NDUwM1oYDzIx
MjYxMTA0MTY0NTAzWjAaMRgwFgYDVQQDDA9ub2RlLWFnZW50LXRlc3QwWTATBgcq
hkjOPQIBBggqhkjOPQMBBwNCAASL36aIaZY8cGzNW/5Ad41zcn7P/ruBkD4tKJrv
tpyhxEiqjIx3LmyjnlPkrJFwPiwhSZzPHKaLXc48Kayu4cD4o1MwUTAdBgNVHQ4E
FgQUKtcLFnr5fOdlF2WJWVXk7F2c0mIwHwYDVR0jBBgwFoAUKtcLFnr5fOdlF2WJ
WVXk7F2c0mIwDwYDVR0TAQH/BAUwAwEB/zAKBggqhkjOPQQDAgNJADBGAiEAsdOg
0HMUovEnERWQLgQR48b2hYphJab0f3rSyBa8AicCIQC2cRknOjWEeZJhWmUWU+fi
2rcfoRRWDTpzo7LuawQrkg==
-----END CERTIFICATE-----
";
const CLIENT_KEY: &str = "-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgGowBjnJ4nGAKFSD/
+LARCic90Msa/nnlbnbsZW3bWnKhRANCAASL36aIaZY8cGzNW/5Ad41zcn7P/ruB
kD4tKJrvtpyhxEiqjIx3LmyjnlPkrJFwPiwhSZzPHKaLXc48Kayu4cD4
-----END PRIVATE KEY-----
";
const KEY: &str = "# the key\n1 rfc4106(gcm(aes)) 00112233445566778899aabbccddeeff01020304 128\n";
/// A hold as an agent before the window count published it (still read: see `hold_file`).
const HOLD: &str = r#"{"kind":"ratio","id":"h1","nodes":["n2"],"stale_nodes":1,"orphans":0,"removed_nodes":1,"known_nodes":2,"ratio":0.5,"node_ratio":0.5,"orphan_ratio":0.0,"max_ratio":0.3,"held_deletes":3,"confirmable_at_unix":null,"message":"held"}"#;

/// The valid content of each input.
fn valid(what: Input) -> Vec<u8> {
    match what {
        Input::NodeList => NODES.into(),
        Input::Kubeconfig => KUBECONFIG.into(),
        Input::Token => b"t\n".to_vec(),
        Input::CaBundle | Input::ClientCertificate => CERT.into(),
        Input::ClientKey => CLIENT_KEY.into(),
        Input::Namespace => b"kube-system\n".to_vec(),
        Input::Checkpoint => checkpoint::encode(&Checkpoint::default()).unwrap(),
        Input::Lock => b"12345\n".to_vec(),
        Input::KeyFile => KEY.into(),
        Input::HoldFile => HOLD.into(),
        Input::Confirmation => b"h1\n".to_vec(),
    }
}

/// Content nested `depth` deep in the input's own syntax, if it has nesting.
fn nested(what: Input, depth: usize) -> Option<Vec<u8>> {
    let open = |o: &str, c: &str| format!("{}{}", o.repeat(depth), c.repeat(depth));
    Some(match what {
        Input::NodeList => format!("kind: List\nitems: [{}]\n", open("[", "]")).into(),
        Input::Kubeconfig => format!("apiVersion: v1\nclusters: {}\n", open("[", "]")).into(),
        Input::HoldFile => format!("{{\"nodes\": {}}}", open("[", "]")).into(),
        Input::Token
        | Input::CaBundle
        | Input::ClientCertificate
        | Input::ClientKey
        | Input::Namespace
        | Input::Checkpoint
        | Input::Lock
        | Input::KeyFile
        | Input::Confirmation => return None,
    })
}

/// The valid content cut short, and what the input's reader makes of it.
fn truncated(what: Input) -> (Vec<u8>, Expect) {
    let v = valid(what);
    match what {
        // Cut inside the item: the item is not a Node (a cut between items is a valid, shorter
        // list; the file source's settle period is what guards against those).
        Input::NodeList => (
            NODES[..NODES.len() - 12].into(),
            Expect::Refused("nodes.yaml"),
        ),
        Input::Kubeconfig => (v[..20].to_vec(), Expect::Refused("kubeconfig")),
        // Content is kube's to judge, and its errors name the kubeconfig that named the file.
        Input::Token => (b"t".to_vec(), Expect::Read),
        // kube's PEM reader skips a block cut short: no CA, and the handshake fails later.
        Input::CaBundle => (v[..v.len() / 2].to_vec(), Expect::Read),
        Input::ClientCertificate | Input::ClientKey => {
            (v[..v.len() / 2].to_vec(), Expect::Refused("kubeconfig"))
        }
        Input::Namespace => (b"kube-".to_vec(), Expect::Read),
        Input::Checkpoint => (v[..v.len() - 1].to_vec(), Expect::Refused("truncated")),
        // An empty lock file is what a new one is.
        Input::Lock => (Vec::new(), Expect::Read),
        Input::KeyFile => (KEY[..KEY.len() - 20].into(), Expect::Refused("ipsec.keys")),
        Input::HoldFile => (v[..v.len() / 2].to_vec(), Expect::Refused("hold.json")),
        Input::Confirmation => (Vec::new(), Expect::Refused("names no hold")),
    }
}

/// Makes `kind` at `path`, returning what the table expects of it; `Err` when this machine
/// cannot make it (said in the output).
fn make(kind: Kind, what: Input, path: &Path) -> Result<Expect, String> {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let dir = path.parent().unwrap();
    let name = path.file_name().unwrap();
    let write = |p: &Path, bytes: &[u8]| std::fs::write(p, bytes).unwrap();
    Ok(match kind {
        Kind::Regular => {
            write(path, &valid(what));
            Expect::Read
        }
        Kind::Symlink => {
            let target = dir.join(".target");
            write(&target, &valid(what));
            std::os::unix::fs::symlink(&target, path).unwrap();
            followed(what, Expect::Read)
        }
        Kind::MountedSecret => {
            let version = dir.join("..2026_11_28_00_00_00.1");
            std::fs::create_dir_all(&version).unwrap();
            write(&version.join(name), &valid(what));
            std::os::unix::fs::symlink("..2026_11_28_00_00_00.1", dir.join("..data")).unwrap();
            let mut link = PathBuf::from("..data");
            link.push(name);
            std::os::unix::fs::symlink(link, path).unwrap();
            followed(what, Expect::Read)
        }
        Kind::Fifo => {
            mkfifo(path)?;
            Expect::Refused("is a FIFO, not a regular file")
        }
        Kind::SymlinkToFifo => {
            let target = dir.join(".fifo");
            mkfifo(&target)?;
            std::os::unix::fs::symlink(&target, path).unwrap();
            followed(what, Expect::Refused("is a FIFO, not a regular file"))
        }
        Kind::Directory => {
            std::fs::create_dir(path).unwrap();
            Expect::Refused("is a directory, not a regular file")
        }
        Kind::CharDevice => {
            // /dev/null's numbers: refused before it is opened, whatever it is.
            mknod(path, libc::S_IFCHR | 0o600, libc::makedev(1, 3))?;
            Expect::Refused("is a character device, not a regular file")
        }
        Kind::Socket => {
            let listener =
                std::os::unix::net::UnixListener::bind(path).map_err(|e| e.to_string())?;
            // The socket file stays when the listener goes.
            drop(listener);
            Expect::Refused("is a socket, not a regular file")
        }
        Kind::Oversized => {
            let f = std::fs::File::create(path).unwrap();
            f.set_len(what.cap() + 1).unwrap();
            Expect::Refused("bytes such a file can hold")
        }
        Kind::DeeplyNested => match nested(what, 100_000) {
            Some(bytes) => {
                write(path, &bytes);
                Expect::Refused(path_name(path))
            }
            None => Expect::NotApplicable,
        },
        Kind::Truncated => {
            let (bytes, expect) = truncated(what);
            write(path, &bytes);
            expect
        }
    })
}

/// What a symlink at input `what` gets: the agent's own files ([`Input::own`]) are never
/// opened through one; the operator's (a Secret's chain of links) are followed to `target`.
fn followed(what: Input, target: Expect) -> Expect {
    match what.own() {
        true => Expect::Refused("is a symbolic link, not a regular file"),
        false => target,
    }
}

fn path_name(path: &Path) -> &'static str {
    // The name each reader's error carries: the tests' paths are fixed, so leak-free statics.
    match path.file_name().unwrap().as_bytes() {
        b"nodes.yaml" => "nodes.yaml",
        b"kubeconfig" => "kubeconfig",
        b"hold.json" => "hold.json",
        other => panic!("no nesting case for {}", String::from_utf8_lossy(other)),
    }
}

fn mkfifo(path: &Path) -> Result<(), String> {
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    if unsafe { libc::mkfifo(c.as_ptr(), 0o600) } != 0 {
        return Err(format!("mkfifo: {}", std::io::Error::last_os_error()));
    }
    Ok(())
}

fn mknod(path: &Path, mode: libc::mode_t, dev: libc::dev_t) -> Result<(), String> {
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    if unsafe { libc::mknod(c.as_ptr(), mode, dev) } != 0 {
        return Err(format!(
            "mknod (needs CAP_MKNOD): {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}

/// Reads input `what` in `dir` with the agent's own reader of it: `Ok` when it was taken.
fn read_with_agent(what: Input, dir: &Path) -> Result<(), String> {
    let path = path_of(what, dir);
    let state = dir.join("state");
    let e = |e: &dyn std::fmt::Display| e.to_string();
    match what {
        Input::NodeList => parse_file(&path).map(drop).map_err(|x| e(&x)),
        Input::Kubeconfig
        | Input::Token
        | Input::CaBundle
        | Input::ClientCertificate
        | Input::ClientKey => {
            let kubeconfig = match what {
                Input::Kubeconfig => path,
                _ => {
                    for other in [
                        Input::Token,
                        Input::CaBundle,
                        Input::ClientCertificate,
                        Input::ClientKey,
                    ] {
                        let p = path_of(other, dir);
                        if other != what {
                            std::fs::write(p, valid(other)).unwrap();
                        }
                    }
                    let kubeconfig = dir.join("kubeconfig");
                    std::fs::write(&kubeconfig, KUBECONFIG_FILES).unwrap();
                    kubeconfig
                }
            };
            let source = KubeSource {
                kubeconfig: Some(kubeconfig),
            };
            node_agent_tests::runtime()
                .block_on(source.client())
                .map(drop)
                .map_err(|x| e(&x))
        }
        Input::Checkpoint => {
            let store = CheckpointStore::open(&state).map_err(|x| e(&x))?;
            match store.load().map_err(|x| e(&x))? {
                LoadOutcome::Loaded(_) => Ok(()),
                LoadOutcome::NotFound => Err("not found".into()),
                LoadOutcome::MovedAside { reason, moved_to } => {
                    // Moved aside, never opened again nor deleted.
                    assert!(std::fs::symlink_metadata(&moved_to).is_ok());
                    assert!(std::fs::symlink_metadata(store.path()).is_err());
                    Err(format!("{reason} (moved aside)"))
                }
            }
        }
        Input::Lock => {
            checkpoint::lock_holder(&state).map_err(|x| e(&x))?;
            CheckpointStore::open(&state).map(drop).map_err(|x| e(&x))
        }
        Input::Namespace => unreachable!("not walked here"),
        Input::KeyFile => KeyFile::load(&path).map(drop).map_err(|x| e(&x)),
        Input::HoldFile => match hold_file::read(&state).map_err(|x| e(&x))? {
            Some(_) => Ok(()),
            None => Err("not found".into()),
        },
        Input::Confirmation => match hold_file::take_confirmation(&state).map_err(|x| e(&x))? {
            Some(_) => Ok(()),
            None => Err("not found".into()),
        },
    }
}

/// The longest any one case may take: parsing what is refused is bounded by the gate and the
/// parsers' limits, so this only catches a case that blocks.
const BOUND: Duration = Duration::from_secs(60);

#[test]
fn every_kind_of_file_at_every_input_is_read_or_refused_naming_it() {
    let mut cases = 0;
    let mut refused = 0;
    let mut skipped = Vec::new();
    let mut not_applicable = 0;
    let mut files = 0;
    for what in Input::ALL {
        if what == Input::Namespace {
            report("input gate: the in-cluster namespace file is walked by kube.rs's unit test");
            continue;
        }
        files += 1;
        for kind in KINDS {
            let dir = tempfile::tempdir().unwrap();
            let path = path_of(what, dir.path());
            let expect = match make(kind, what, &path) {
                Ok(e) => e,
                Err(why) => {
                    skipped.push(format!("{kind:?} at the {}: {why}", what.what()));
                    continue;
                }
            };
            if matches!(expect, Expect::NotApplicable) {
                not_applicable += 1;
                continue;
            }
            let (tx, rx) = mpsc::channel();
            let root = dir.path().to_owned();
            std::thread::spawn(move || {
                let _ = tx.send(read_with_agent(what, &root));
            });
            let got = match rx.recv_timeout(BOUND) {
                Ok(got) => got,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    panic!(
                        "{kind:?} at the {} ({}): still reading after {BOUND:?}",
                        what.what(),
                        path.display()
                    )
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    panic!("{kind:?} at the {}: the reader panicked", what.what())
                }
            };
            cases += 1;
            match (&expect, &got) {
                (Expect::Read, Ok(())) => {}
                (Expect::Refused(text), Err(msg)) => {
                    refused += 1;
                    assert!(
                        msg.contains(text),
                        "{kind:?} at the {}: {msg:?} does not say {text:?}",
                        what.what()
                    );
                    let name = path.file_name().unwrap().to_str().unwrap();
                    // A file the kubeconfig names is refused naming the field too.
                    let field = match what {
                        Input::Token => "user \"u\" tokenFile",
                        Input::CaBundle => "cluster \"c\" certificate-authority",
                        Input::ClientCertificate => "user \"u\" client-certificate",
                        Input::ClientKey => "user \"u\" client-key",
                        _ => "",
                    };
                    let gate = !matches!(kind, Kind::Truncated);
                    let name = match (gate, field) {
                        (false, f) if !f.is_empty() => "kubeconfig",
                        _ => name,
                    };
                    assert!(
                        !gate || msg.contains(field),
                        "{kind:?} at the {}: {msg:?} does not name the kubeconfig field",
                        what.what()
                    );
                    assert!(
                        msg.contains(name) || matches!(what, Input::Checkpoint),
                        "{kind:?} at the {}: {msg:?} does not name the file",
                        what.what()
                    );
                }
                _ => panic!(
                    "{kind:?} at the {}: expected {expect:?}, got {got:?}",
                    what.what()
                ),
            }
        }
    }
    for s in &skipped {
        report(&format!("input gate: skipped {s}"));
    }
    report(&format!(
        "input gate: {} file kinds x {} files = {cases} cases read or refused ({refused} refused), \
         {not_applicable} not applicable to the format, {} skipped",
        KINDS.len(),
        files,
        skipped.len()
    ));
    assert!(cases >= 60, "too few cases ran: {cases}");
}

/// The nodes file's JSON has the same bound on nesting as its YAML, and a list cut short is
/// refused in both.
#[test]
fn the_nodes_files_json_is_bounded_like_its_yaml() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nodes.json");
    let deep = format!(
        "{{\"items\": [{}{}]}}",
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    std::fs::write(&path, deep).unwrap();
    let err = parse_file(&path).unwrap_err().to_string();
    assert!(err.contains("nodes.json"), "{err}");
    std::fs::write(
        &path,
        r#"{"kind":"List","items":[{"metadata":{"name":"n1"}}"#,
    )
    .unwrap();
    let err = parse_file(&path).unwrap_err().to_string();
    assert!(err.contains("nodes.json"), "{err}");
}
