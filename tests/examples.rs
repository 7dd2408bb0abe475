//! Every command the README shows, and every config in `examples/`, runs
//! as written against a real `daxkv serve`.
//!
//! # Which README commands run, and how
//!
//! - Every fenced block whose info string is `sh` is run, top to bottom,
//!   unless the line just above its fence is
//!   `<!-- examples: not run: REASON -->` (a reason is required). Other
//!   info strings (`rust`, `toml`, `json`, `text`) are not shell.
//! - A line is one command (a `\` at the end continues it); a ` #` outside
//!   quotes starts a comment, which is not part of the command.
//! - A command runs if it starts with `daxkv `, `curl `, `truncate ` or
//!   `rm /dev/shm/daxkv-`; `export PATH=` lines set up the reader's shell
//!   and are skipped (here `daxkv` is the binary cargo built for this
//!   test, first on `PATH`). Any other command in a block that runs fails
//!   the test: mark the block not run, or teach this file to run it.
//! - `cargo run --release -- ARGS` (the README's way to run the binary in
//!   the terminal without `PATH` set) is `daxkv ARGS`.
//! - Commands run against one server, in order. Until the first
//!   `daxkv serve …` line it is `daxkv serve` on its embedded default (what
//!   the README's first command starts); a `daxkv serve …` line stops the
//!   server (SIGTERM; it must exit 0) and starts that one in the
//!   background, as the reader does in the first terminal.
//! - Rewritten before running: `127.0.0.1:8765` (the default address)
//!   becomes the test server's (started on `--http 127.0.0.1:0`);
//!   `daxkv status | add | remove | resize` get `--server ADDR`;
//!   `/dev/shm/daxkv-NAME` becomes a name unique to this run (removed at
//!   the end). Commands run under `bash -o pipefail` in the repository
//!   root, so a `| grep` that finds nothing fails too.
//! - A command fails the test when it exits non-zero, or prints `"error"`
//!   or `unhealthy` (curl exits 0 on an error status). The failure names
//!   the README line, the command as run, and what it printed.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_daxkv");

/// The address the README's commands name (`daxkv serve`'s default).
const README_ADDR: &str = "127.0.0.1:8765";

/// The client commands that take `--server`.
const CLIENT_COMMANDS: [&str; 4] = ["status", "add", "remove", "resize"];

/// How long one command, or one server's start or stop, may take.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(120);

/// The prefix of the scratch paths the README may create.
const SCRATCH: &str = "/dev/shm/daxkv-";

/// The marker line that keeps a block from running.
const NOT_RUN: &str = "<!-- examples: not run:";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// One command of a block that runs.
#[derive(Debug, PartialEq)]
struct Cmd {
    /// 1-based line of the README where the command starts.
    line: usize,
    /// The command, comment and continuations removed.
    text: String,
}

/// A README block's commands, or why a block is refused.
#[derive(Debug, PartialEq)]
enum Block {
    Run(Vec<Cmd>),
    NotRun { line: usize },
}

/// The command part of `line`: everything before a ` #` outside quotes.
fn strip_comment(line: &str) -> &str {
    let (mut single, mut double) = (false, false);
    let mut prev = ' ';
    for (i, c) in line.char_indices() {
        match c {
            '\'' if !double => single = !single,
            '"' if !single => double = !double,
            '#' if !single && !double && prev.is_whitespace() => return line[..i].trim_end(),
            _ => {}
        }
        prev = c;
    }
    line.trim_end()
}

/// The `sh` blocks of `markdown`, in order; `Err` names a marker without a
/// reason or an unterminated block.
fn blocks(markdown: &str) -> Result<Vec<Block>, String> {
    let lines: Vec<&str> = markdown.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let Some(info) = lines[i].trim_start().strip_prefix("```") else {
            i += 1;
            continue;
        };
        let fence_line = i + 1;
        let is_sh = info.trim() == "sh";
        let marker = i
            .checked_sub(1)
            .map(|p| lines[p].trim())
            .filter(|l| l.starts_with(NOT_RUN));
        if let Some(m) = marker {
            let reason = m[NOT_RUN.len()..].trim_end_matches("-->").trim();
            if reason.is_empty() {
                return Err(format!("README.md:{i}: a not-run marker needs a reason"));
            }
        }
        // Find the closing fence.
        let mut end = i + 1;
        while end < lines.len() && lines[end].trim() != "```" {
            end += 1;
        }
        if end == lines.len() {
            return Err(format!("README.md:{fence_line}: the block never ends"));
        }
        if is_sh {
            if marker.is_some() {
                out.push(Block::NotRun { line: fence_line });
            } else {
                let mut cmds = Vec::new();
                let mut pending: Option<Cmd> = None;
                for (k, raw) in lines.iter().enumerate().take(end).skip(i + 1) {
                    let text = strip_comment(raw);
                    let (text, continues) = match text.strip_suffix('\\') {
                        Some(t) => (t.trim_end(), true),
                        None => (text, false),
                    };
                    let cmd = pending.get_or_insert(Cmd {
                        line: k + 1,
                        text: String::new(),
                    });
                    if !text.trim().is_empty() {
                        if !cmd.text.is_empty() {
                            cmd.text.push(' ');
                        }
                        cmd.text.push_str(text.trim());
                    }
                    if !continues {
                        let cmd = pending.take().unwrap();
                        if !cmd.text.is_empty() {
                            cmds.push(cmd);
                        }
                    }
                }
                // A `\` on the block's last line: the command ends there.
                cmds.extend(pending.filter(|c| !c.text.is_empty()));
                out.push(Block::Run(cmds));
            }
        }
        i = end + 1;
    }
    Ok(out)
}

/// What the harness does with one command.
#[derive(Debug, PartialEq)]
enum Action {
    /// Start this `daxkv serve` (its arguments after `serve`).
    Serve(String),
    /// Run it in bash.
    Run,
    /// Set up the reader's shell only.
    Skip,
}

/// The `cargo run` prefix that stands for `daxkv `.
const CARGO_RUN: &str = "cargo run --release -- ";

/// `cmd` with a leading `cargo run --release -- ` written as `daxkv `.
fn as_daxkv(cmd: &str) -> String {
    match cmd.strip_prefix(CARGO_RUN) {
        Some(rest) => format!("daxkv {rest}"),
        None => cmd.to_string(),
    }
}

fn action(cmd: &str) -> Result<Action, String> {
    if let Some(rest) = cmd.strip_prefix("daxkv serve") {
        if rest.is_empty() || rest.starts_with(' ') {
            return Ok(Action::Serve(rest.trim().to_string()));
        }
    }
    if cmd.starts_with("export PATH=") {
        return Ok(Action::Skip);
    }
    let runs = ["daxkv ", "curl ", "truncate "]
        .iter()
        .any(|p| cmd.starts_with(p))
        || cmd.starts_with(&format!("rm {SCRATCH}"))
        || cmd.starts_with(&format!("rm -f {SCRATCH}"));
    if runs {
        Ok(Action::Run)
    } else {
        Err(format!(
            "`{cmd}` is neither run by tests/examples.rs nor in a block marked \
             `{NOT_RUN} REASON -->`"
        ))
    }
}

/// `text` with every `/dev/shm/daxkv-NAME` made unique to this run; the
/// paths are added to `made`.
fn scratch_paths(text: &str, tag: &str, made: &mut Vec<PathBuf>) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find(SCRATCH) {
        let after = &rest[at + SCRATCH.len()..];
        let end = after
            .find(|c: char| !(c.is_ascii_alphanumeric() || "._-".contains(c)))
            .unwrap_or(after.len());
        let unique = format!("{SCRATCH}{}-{tag}", &after[..end]);
        made.push(PathBuf::from(&unique));
        out.push_str(&rest[..at]);
        out.push_str(&unique);
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

/// `text` pointed at the server at `addr`.
fn at_server(text: &str, addr: &str) -> String {
    let mut t = text.replace(README_ADDR, addr);
    if !t.contains("--server") {
        for sub in CLIENT_COMMANDS {
            let word = format!("daxkv {sub}");
            let mut out = String::new();
            let mut rest = t.as_str();
            while let Some(at) = rest.find(&word) {
                let end = at + word.len();
                let whole = rest[end..].chars().next().is_none_or(char::is_whitespace);
                out.push_str(&rest[..end]);
                if whole {
                    out.push_str(" --server ");
                    out.push_str(addr);
                }
                rest = &rest[end..];
            }
            out.push_str(rest);
            t = out;
        }
    }
    t
}

/// A bash command line with `daxkv` (this build) first on `PATH`.
fn bash(cmd: &str) -> Command {
    let bin_dir = Path::new(BIN).parent().unwrap();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut c = Command::new("bash");
    c.args(["-o", "pipefail", "-c", cmd])
        .env("PATH", path)
        .env_remove("DAXKV_TOKEN")
        .current_dir(root());
    c
}

/// Read all of `r` on a thread.
fn drain(mut r: impl Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = r.read_to_string(&mut s);
        let _ = tx.send(s);
    });
    rx
}

/// Wait for `child` at most `limit`; kill it past that.
fn wait_bounded(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let t0 = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Run `cmd` to completion: `Err` says why it failed, with its output.
fn run(cmd: &str) -> Result<String, String> {
    let mut child = bash(cmd)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start bash: {e}"))?;
    let out = drain(child.stdout.take().unwrap());
    let err = drain(child.stderr.take().unwrap());
    let status = wait_bounded(&mut child, COMMAND_TIMEOUT);
    let printed = format!(
        "{}{}",
        out.recv_timeout(COMMAND_TIMEOUT).unwrap_or_default(),
        err.recv_timeout(COMMAND_TIMEOUT).unwrap_or_default()
    );
    match status {
        None => Err(format!(
            "still running after {COMMAND_TIMEOUT:?}; printed:\n{printed}"
        )),
        Some(s) if !s.success() => Err(format!("{s}; printed:\n{printed}")),
        Some(_) if printed.contains("\"error\"") || printed.contains("unhealthy") => {
            Err(format!("printed an error:\n{printed}"))
        }
        Some(_) => Ok(printed),
    }
}

/// A `daxkv serve` running in the background.
struct Server {
    child: Child,
    addr: String,
    stderr: mpsc::Receiver<String>,
    what: String,
}

impl Server {
    /// Start `daxkv serve ARGS` on a free loopback port and wait until it
    /// says where it serves.
    fn start(args: &str) -> Result<Server, String> {
        let args = if args.contains("--http") {
            args.to_string()
        } else {
            format!("{args} --http 127.0.0.1:0")
        };
        let what = format!("daxkv serve {args}");
        let mut child = bash(&format!("exec {what}"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start `{what}`: {e}"))?;
        let stderr = drain(child.stderr.take().unwrap());
        let (tx, rx) = mpsc::channel();
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let first = lines.next().and_then(Result::ok).unwrap_or_default();
            let _ = tx.send(first);
            // Keep reading so the server never blocks on a full pipe.
            for _ in lines {}
        });
        let first = rx.recv_timeout(COMMAND_TIMEOUT).unwrap_or_default();
        let Some(addr) = first.trim().strip_prefix("daxkv: serving on http://") else {
            let _ = child.kill();
            let _ = child.wait();
            let log = stderr.recv_timeout(COMMAND_TIMEOUT).unwrap_or_default();
            return Err(format!(
                "`{what}` did not start (first line {first:?}); stderr:\n{log}"
            ));
        };
        Ok(Server {
            addr: addr.to_string(),
            child,
            stderr,
            what,
        })
    }

    /// SIGTERM; it must exit 0 in bounded time.
    fn stop(mut self) -> Result<(), String> {
        // SAFETY: kill(2) on our own child's pid (bash exec'd daxkv).
        unsafe { libc::kill(self.child.id().cast_signed(), libc::SIGTERM) };
        let status = wait_bounded(&mut self.child, COMMAND_TIMEOUT);
        let log = self
            .stderr
            .recv_timeout(COMMAND_TIMEOUT)
            .unwrap_or_default();
        match status {
            Some(s) if s.success() => Ok(()),
            Some(s) => Err(format!(
                "`{}` exited {s} on SIGTERM; stderr:\n{log}",
                self.what
            )),
            None => Err(format!("`{}` did not stop on SIGTERM", self.what)),
        }
    }
}

/// The server and the scratch files of a run, cleaned up however it ends.
struct Run {
    server: Option<Server>,
    made: Vec<PathBuf>,
}

impl Drop for Run {
    fn drop(&mut self) {
        if let Some(mut s) = self.server.take() {
            let _ = s.child.kill();
            let _ = s.child.wait();
        }
        for p in &self.made {
            let _ = std::fs::remove_file(p);
        }
    }
}

#[test]
fn the_extractor_follows_the_convention() {
    let md = "intro\n\
        ```sh\n\
        daxkv status          # the devices\n\
        curl -s -d '{\"a\": \"#x\"}' \\\n\
             127.0.0.1:8765/x  # sends\n\
        ```\n\
        <!-- examples: not run: starts a server in the foreground -->\n\
        ```sh\n\
        cargo run -- serve\n\
        ```\n\
        ```rust\n\
        fn main() {}\n\
        ```\n";
    let b = blocks(md).unwrap();
    assert_eq!(
        b,
        [
            Block::Run(vec![
                Cmd {
                    line: 3,
                    text: "daxkv status".into()
                },
                Cmd {
                    line: 4,
                    text: "curl -s -d '{\"a\": \"#x\"}' 127.0.0.1:8765/x".into()
                },
            ]),
            Block::NotRun { line: 8 },
        ]
    );
    assert!(blocks("<!-- examples: not run: -->\n```sh\nls\n```\n").is_err());
    assert_eq!(
        action("daxkv serve --traffic"),
        Ok(Action::Serve("--traffic".into()))
    );
    assert_eq!(action("daxkv serve"), Ok(Action::Serve(String::new())));
    assert_eq!(
        action("export PATH=\"$PWD/target/release:$PATH\""),
        Ok(Action::Skip)
    );
    assert_eq!(action("rm /dev/shm/daxkv-try"), Ok(Action::Run));
    assert!(action("rm -rf /").is_err());
    assert!(action("cargo run -- serve").is_err());
    assert_eq!(
        as_daxkv("cargo run --release -- serve --traffic"),
        "daxkv serve --traffic"
    );
    assert_eq!(
        at_server(
            "daxkv status --json && curl -s 127.0.0.1:8765/health",
            "127.0.0.1:9"
        ),
        "daxkv status --server 127.0.0.1:9 --json && curl -s 127.0.0.1:9/health"
    );
    assert_eq!(
        at_server("daxkv add memfd:b 1MiB", "127.0.0.1:9"),
        "daxkv add --server 127.0.0.1:9 memfd:b 1MiB"
    );
    let mut made = Vec::new();
    assert_eq!(
        scratch_paths(
            "daxkv add /dev/shm/daxkv-try 1MiB; rm /dev/shm/daxkv-try",
            "7",
            &mut made
        ),
        "daxkv add /dev/shm/daxkv-try-7 1MiB; rm /dev/shm/daxkv-try-7"
    );
    assert_eq!(made.len(), 2);
}

/// The README's `sh` blocks, run in order against a real `daxkv serve`.
#[test]
fn the_readme_commands_run_as_written() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let blocks = blocks(&readme).unwrap_or_else(|e| panic!("{e}"));
    let tag = format!(
        "{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    );
    let mut run_state = Run {
        server: None,
        made: Vec::new(),
    };
    let mut ran = 0;
    for block in &blocks {
        let Block::Run(cmds) = block else { continue };
        for cmd in cmds {
            let at = format!("README.md:{}: `{}`", cmd.line, cmd.text);
            let text = as_daxkv(&cmd.text);
            match action(&text).unwrap_or_else(|e| panic!("README.md:{}: {e}", cmd.line)) {
                Action::Skip => {}
                Action::Serve(args) => {
                    if let Some(old) = run_state.server.take() {
                        old.stop()
                            .unwrap_or_else(|e| panic!("{at}: stopping the last server: {e}"));
                    }
                    let args = scratch_paths(&args, &tag, &mut run_state.made);
                    let s = Server::start(&args).unwrap_or_else(|e| panic!("{at}: {e}"));
                    println!("README.md:{}: {} (serving on {})", cmd.line, s.what, s.addr);
                    run_state.server = Some(s);
                    ran += 1;
                }
                Action::Run => {
                    if run_state.server.is_none() {
                        let s = Server::start("")
                            .unwrap_or_else(|e| panic!("{at}: the embedded default: {e}"));
                        run_state.server = Some(s);
                    }
                    let addr = run_state.server.as_ref().unwrap().addr.clone();
                    let text = scratch_paths(&text, &tag, &mut run_state.made);
                    let text = at_server(&text, &addr);
                    match run(&text) {
                        Ok(printed) => println!("README.md:{}: {text}\n{printed}", cmd.line),
                        Err(e) => panic!("{at} failed (run as `{text}`): {e}"),
                    }
                    ran += 1;
                }
            }
        }
    }
    if let Some(s) = run_state.server.take() {
        s.stop()
            .unwrap_or_else(|e| panic!("README.md: stopping the last server: {e}"));
    }
    assert!(ran > 0, "README.md has no `sh` block that runs");
}

/// The device paths a config in `examples/` names.
fn device_paths(file: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(file).unwrap();
    let v: serde_json::Value = if file.extension().is_some_and(|e| e == "toml") {
        toml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()))
    } else {
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()))
    };
    let devices = v["devices"].as_array().cloned().unwrap_or_default();
    devices
        .iter()
        .map(|d| d["device_path"].as_str().unwrap().to_string())
        .collect()
}

/// Every config in `examples/` starts `daxkv serve --config` on a fresh
/// machine: it serves, `/health` is ok, status lists each device it names,
/// and SIGTERM stops it with exit 0.
#[test]
fn every_example_config_serves() {
    let mut configs: Vec<PathBuf> = std::fs::read_dir(root().join("examples"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json" || e == "toml"))
        .collect();
    configs.sort();
    assert!(!configs.is_empty(), "no config in examples/");
    for cfg in configs {
        let rel = cfg.strip_prefix(root()).unwrap().display().to_string();
        let s = Server::start(&format!("--config {rel}")).unwrap_or_else(|e| panic!("{rel}: {e}"));
        let health = run(&format!("curl -s {}/health", s.addr));
        assert_eq!(
            health.as_deref().map(str::trim),
            Ok(r#"{"status":"ok"}"#),
            "{rel}: /health"
        );
        let status = run(&format!("daxkv status --server {}", s.addr))
            .unwrap_or_else(|e| panic!("{rel}: {e}"));
        for path in device_paths(&cfg) {
            assert!(
                status.contains(&path),
                "{rel}: status does not list {path}:\n{status}"
            );
        }
        s.stop().unwrap_or_else(|e| panic!("{rel}: {e}"));
    }
}
