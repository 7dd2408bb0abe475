//! `daxkv serve` as a child process for the integration tests (`serve`,
//! `serve_ops`; included with `#[path]`, not a test crate): started on a
//! free loopback port, driven by the real CLI and HTTP, stopped by a
//! signal (exit 0, port closed).
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use daxkv::cli::serve::request;
use serde_json::Value;

pub const BIN: &str = env!("CARGO_BIN_EXE_daxkv");

pub struct Serve {
    pub child: Child,
    pub addr: String,
}

impl Serve {
    pub fn start(args: &[&str]) -> Serve {
        let mut cmd = Command::new(BIN);
        cmd.arg("serve").args(["--http", "127.0.0.1:0"]).args(args);
        Serve::spawn(&mut cmd)
    }

    /// Spawn `cmd` (a `daxkv serve` command line) with piped output and
    /// wait for the line that says where it serves.
    pub fn spawn(cmd: &mut Command) -> Serve {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line
            .trim()
            .strip_prefix("daxkv: serving on http://")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
            .to_string();
        Serve { child, addr }
    }

    pub fn get(&self, path: &str) -> (u16, String) {
        request(&self.addr, "GET", path, None, None).unwrap()
    }

    pub fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let (s, b) = request(&self.addr, "POST", path, Some(body), None).unwrap();
        (s, serde_json::from_str(&b).unwrap())
    }

    pub fn cli(&self, args: &[&str]) -> std::process::Output {
        Command::new(BIN)
            .args(args)
            .args(["--server", &self.addr])
            .output()
            .unwrap()
    }

    /// Send `sig`; the process must exit 0 within 30 s and its port close.
    pub fn stop_with(mut self, sig: i32) -> String {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id().cast_signed(), sig) };
        let t0 = Instant::now();
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            assert!(t0.elapsed() < Duration::from_secs(30), "serve did not stop");
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut err = String::new();
        std::io::Read::read_to_string(&mut self.child.stderr.take().unwrap(), &mut err).unwrap();
        assert!(status.success(), "exit {status:?}; stderr:\n{err}");
        assert!(
            std::net::TcpStream::connect(&self.addr).is_err(),
            "the control plane still listens after exit"
        );
        err
    }
    /// Run a command that must succeed; its stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.cli(args);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// Run a command that must fail with exit 1; its stderr.
    pub fn fails(&self, args: &[&str]) -> String {
        let out = self.cli(args);
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        err
    }

    pub fn health(&self) -> (u16, Value) {
        let (code, body) = request(&self.addr, "GET", "/health", None, None).unwrap();
        (code, serde_json::from_str(&body).unwrap())
    }

    /// `(path, state)` of every device, from `status --json`.
    pub fn devices(&self) -> Vec<(String, String)> {
        let v: Value = serde_json::from_str(&self.ok(&["status", "--json"])).unwrap();
        v["adapters"][0]["status"]["devices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| {
                (
                    d["device_path"].as_str().unwrap().to_string(),
                    d["state"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    }

    /// SIGTERM; exit 0 within 30 s, port closed; its stderr.
    pub fn stop(self) -> String {
        self.stop_with(libc::SIGTERM)
    }
}
