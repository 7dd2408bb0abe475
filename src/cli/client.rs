//! # The control plane's client (`daxkv status | add | remove | resize`)
//!
//! One HTTP/1.1 request per connection, `Connection: close`, with a bound
//! on everything the server controls:
//!
//! | bound | default | past it |
//! |---|---|---|
//! | the whole exchange (connect, send, answer) | [`DEFAULT_TIMEOUT`] (`--timeout`) | [`ClientError::Timeout`], which says the operation may still run on the server |
//! | the answer's head | [`MAX_HEAD_BYTES`] | [`ClientError::TooLarge`] |
//! | the whole answer, head and body | [`MAX_ANSWER_BYTES`] | [`ClientError::TooLarge`] |
//! | the answer's shape | a daxkv status / operation document ([`check_answer`]) | [`ClientError::NotDaxkv`] |
//!
//! `--server` is `host:port` or `http://host:port` ([`parse_server`]): a
//! path, a query, user info, another scheme (`https://`) or a missing port
//! is an error that names what is wrong, before anything is sent.

#![forbid(unsafe_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use serde_json::Value;

/// How long a command waits for the whole exchange by default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// The largest answer read (head and body). A status lists every device
/// ever removed (a tombstone of ~390 bytes; ids are never reused): 64 MiB
/// is some 170 000 add / remove cycles (4 MiB, before, was 11 000: weeks
/// of a controller that scales devices).
pub const MAX_ANSWER_BYTES: usize = 64 << 20;

/// The largest answer head: daxkv's is a few hundred bytes.
pub const MAX_HEAD_BYTES: usize = 64 << 10;

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// `--server` is not `host:port` / `http://host:port`.
    #[error("--server {server:?}: {why}")]
    Server {
        /// What was given.
        server: String,
        /// What is wrong with it.
        why: String,
    },
    /// The server could not be reached.
    #[error("{server}: cannot reach the server: {error}")]
    Connect {
        /// The authority.
        server: String,
        /// Why (in the message, not a `source`: printed once).
        error: std::io::Error,
    },
    /// No complete answer within the timeout.
    #[error(
        "{server}: no answer within {secs} s (--timeout); \
         an operation may still be running on the server: see `daxkv status`"
    )]
    Timeout {
        /// The authority.
        server: String,
        /// The timeout, in seconds.
        secs: f64,
    },
    /// The answer (or its head) was larger than [`MAX_ANSWER_BYTES`]
    /// ([`MAX_HEAD_BYTES`]).
    #[error("{server}: the answer is larger than {limit} bytes: not a daxkv server?")]
    TooLarge {
        /// The authority.
        server: String,
        /// The limit.
        limit: usize,
    },
    /// Not an HTTP answer, or the connection broke.
    #[error("{server}: {why}")]
    Protocol {
        /// The authority.
        server: String,
        /// What was wrong.
        why: String,
    },
    /// An answer, but not one a daxkv server gives.
    #[error("{server}: {status} answer is not a daxkv answer ({why}): is this a daxkv server?")]
    NotDaxkv {
        /// The authority.
        server: String,
        /// The HTTP status.
        status: u16,
        /// What was missing.
        why: String,
    },
}

/// For a command-line client: end quietly (SIGPIPE) when the reader of
/// stdout goes away (`daxkv status | head -1`) instead of panicking in
/// `println!`. Not for a server: a peer closing a socket must not kill it.
pub fn quiet_on_closed_stdout() {
    crate::host::sys::default_sigpipe();
}

/// The authority (`host:port`) of a `--server` value: `host:port` or
/// `http://host:port`, one trailing `/` allowed.
pub fn parse_server(server: &str) -> Result<String, ClientError> {
    let bad = |why: String| ClientError::Server {
        server: server.to_string(),
        why,
    };
    let s = server.trim();
    if s.is_empty() {
        return Err(bad("empty: give host:port (e.g. 127.0.0.1:8765)".into()));
    }
    let rest = match s.split_once("://") {
        Some((scheme, rest)) if scheme.eq_ignore_ascii_case("http") => rest,
        Some((scheme, _)) => {
            return Err(bad(format!(
                "the scheme {scheme}:// is not supported: the control plane speaks plain \
                 HTTP (give host:port or http://host:port)"
            )))
        }
        None => s,
    };
    if rest.starts_with('/') {
        return Err(bad(
            "is a path, not host:port: the control plane listens on TCP (give host:port, \
             e.g. 127.0.0.1:8765)"
                .into(),
        ));
    }
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if let Some(i) = rest.find('/') {
        return Err(bad(format!(
            "has a path ({}): give host:port only; each command adds its own route",
            &rest[i..]
        )));
    }
    if rest.contains(['?', '#']) {
        return Err(bad("has a query or fragment: give host:port only".into()));
    }
    if rest.contains('@') {
        return Err(bad(
            "has user info: give host:port only (a bearer token goes in --token or \
             DAXKV_TOKEN)"
                .into(),
        ));
    }
    let port = match rest.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && !host.ends_with(':') => port,
        _ => {
            return Err(bad(
                "no port: give host:port (e.g. 127.0.0.1:8765; IPv6 as [::1]:8765)".into(),
            ))
        }
    };
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(rest.to_string()),
        _ => Err(bad(format!("bad port {port:?}: give a port 1-65535"))),
    }
}

/// A client of one server.
#[derive(Debug, Clone)]
pub struct Client {
    authority: String,
    token: Option<String>,
    timeout: Duration,
}

impl Client {
    /// A client of `server` (see [`parse_server`]), sending `token` as a
    /// bearer token, giving up after `timeout`.
    pub fn new(
        server: &str,
        token: Option<&str>,
        timeout: Duration,
    ) -> Result<Client, ClientError> {
        if timeout.is_zero() {
            return Err(ClientError::Server {
                server: server.to_string(),
                why: "the timeout must be > 0".into(),
            });
        }
        Ok(Client {
            authority: parse_server(server)?,
            token: token.map(str::to_owned),
            timeout,
        })
    }

    /// The `host:port` requests go to.
    pub fn authority(&self) -> &str {
        &self.authority
    }

    /// One request: `(status, body)`, the body read whole (bounded).
    pub fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<(u16, String), ClientError> {
        let deadline = Instant::now() + self.timeout;
        let server = || self.authority.clone();
        let timed_out = || ClientError::Timeout {
            server: server(),
            secs: self.timeout.as_secs_f64(),
        };
        let left = || {
            deadline
                .checked_duration_since(Instant::now())
                .filter(|d| !d.is_zero())
        };
        let addrs: Vec<SocketAddr> = self
            .authority
            .to_socket_addrs()
            .map_err(|error| ClientError::Connect {
                server: server(),
                error,
            })?
            .collect();
        let mut stream = None;
        let mut last = std::io::Error::other("the name has no address");
        for a in &addrs {
            let Some(t) = left() else {
                return Err(timed_out());
            };
            match TcpStream::connect_timeout(a, t) {
                Ok(s) => {
                    stream = Some(s);
                    break;
                }
                Err(e) => last = e,
            }
        }
        let Some(mut s) = stream else {
            if last.kind() == std::io::ErrorKind::TimedOut {
                return Err(timed_out());
            }
            return Err(ClientError::Connect {
                server: server(),
                error: last,
            });
        };
        let io = |e: std::io::Error| {
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) {
                timed_out()
            } else {
                ClientError::Protocol {
                    server: server(),
                    why: format!("connection broken: {e}"),
                }
            }
        };
        let body = body.map(Value::to_string).unwrap_or_default();
        let auth = self
            .token
            .as_deref()
            .map(|t| format!("Authorization: Bearer {t}\r\n"))
            .unwrap_or_default();
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n{auth}\
             Accept: application/json\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            self.authority,
            body.len()
        );
        s.set_write_timeout(Some(left().ok_or_else(timed_out)?))
            .map_err(io)?;
        s.write_all(request.as_bytes()).map_err(io)?;
        let mut answer = Answer::default();
        let mut chunk = [0u8; 16 << 10];
        loop {
            s.set_read_timeout(Some(left().ok_or_else(timed_out)?))
                .map_err(io)?;
            match s.read(&mut chunk) {
                Ok(0) => break,
                Ok(n) => match answer.push(&chunk[..n]) {
                    Ok(true) => break,
                    Ok(false) => {}
                    Err(limit) => {
                        return Err(ClientError::TooLarge {
                            server: server(),
                            limit,
                        })
                    }
                },
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io(e)),
            }
        }
        parse_answer(&answer.raw).map_err(|why| ClientError::Protocol {
            server: server(),
            why,
        })
    }
}

/// An answer as it arrives: its bytes, where its head ends once seen
/// (searched in the new bytes only, so a long head costs linear time), and
/// its whole length once the head has a `Content-Length`.
#[derive(Default)]
struct Answer {
    raw: Vec<u8>,
    head_end: Option<usize>,
    whole: Option<usize>,
}

impl Answer {
    /// Add `bytes`: `Ok(true)` once the answer is whole, `Err(limit)` past
    /// [`MAX_ANSWER_BYTES`] or, head not ended, [`MAX_HEAD_BYTES`].
    fn push(&mut self, bytes: &[u8]) -> Result<bool, usize> {
        if self.raw.len() + bytes.len() > MAX_ANSWER_BYTES {
            return Err(MAX_ANSWER_BYTES);
        }
        let from = self.raw.len().saturating_sub(3);
        self.raw.extend_from_slice(bytes);
        if self.head_end.is_none() {
            self.head_end = self.raw[from..]
                .windows(4)
                .position(|w| w == b"\r\n\r\n")
                .map(|i| from + i);
            match self.head_end {
                None if self.raw.len() > MAX_HEAD_BYTES => return Err(MAX_HEAD_BYTES),
                None => return Ok(false),
                Some(end) => self.whole = content_length(&self.raw[..end]).map(|n| end + 4 + n),
            }
        }
        Ok(self.whole.is_some_and(|w| self.raw.len() >= w))
    }
}

/// The `Content-Length` of an answer's head, if it has one: the answer is
/// whole once that much body is read (the server may keep the connection
/// open after it).
fn content_length(head: &[u8]) -> Option<usize> {
    let head = String::from_utf8_lossy(head);
    head.split("\r\n").skip(1).find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim()
            .eq_ignore_ascii_case("content-length")
            .then(|| v.trim().parse::<usize>().ok())?
    })
}

/// `(status, body)` of a whole HTTP/1.x answer.
fn parse_answer(raw: &[u8]) -> Result<(u16, String), String> {
    if raw.is_empty() {
        return Err("the server closed the connection without an answer".into());
    }
    let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
        return Err("not an HTTP answer (no complete head)".into());
    };
    let head = String::from_utf8_lossy(&raw[..end]);
    let rest = &raw[end + 4..];
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let mut parts = status_line.split(' ');
    let (Some(version), Some(code)) = (parts.next(), parts.next()) else {
        return Err("not an HTTP answer (bad status line)".into());
    };
    let status = match code.parse::<u16>() {
        Ok(c) if version.starts_with("HTTP/1.") && (100..=599).contains(&c) => c,
        _ => return Err("not an HTTP answer (bad status line)".into()),
    };
    let header = |name: &str| {
        head.split("\r\n").skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_string())
        })
    };
    let body = if header("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        unchunk(rest).ok_or("a broken chunked body")?
    } else if let Some(n) = header("content-length") {
        let n: usize = n.parse().map_err(|_| "a bad Content-Length")?;
        rest.get(..n)
            .ok_or("a body shorter than its Content-Length")?
            .to_vec()
    } else {
        rest.to_vec()
    };
    let body = String::from_utf8(body).map_err(|_| "a body that is not UTF-8")?;
    Ok((status, body))
}

/// Decode a chunked body; `None` when it is cut short or malformed.
fn unchunk(mut s: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let eol = s.windows(2).position(|w| w == b"\r\n")?;
        let size = std::str::from_utf8(&s[..eol]).ok()?;
        let size = size.split(';').next()?.trim();
        let n = usize::from_str_radix(size, 16).ok()?;
        s = &s[eol + 2..];
        if n == 0 {
            return Some(out);
        }
        out.extend_from_slice(s.get(..n)?);
        s = s.get(n..)?.strip_prefix(b"\r\n")?;
    }
}

/// What a command expects back on success.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// `GET /reconfigure/dax/l2/status`: the status envelope.
    Status,
    /// A DAX operation answering with one of these `operation` names.
    Operation(&'static [&'static str]),
}

/// Whether `v` (a 2xx answer's body) is what a daxkv server answers to
/// the request: `Err` names what is missing.
pub fn check_answer(expect: Expect, v: &Value) -> Result<(), String> {
    let o = v.as_object().ok_or("not a JSON object")?;
    match expect {
        Expect::Status => {
            if o.get("backend").and_then(Value::as_str) != Some("dax") {
                return Err("no \"backend\": \"dax\"".into());
            }
            let adapters = o
                .get("adapters")
                .and_then(Value::as_array)
                .ok_or("no \"adapters\" list")?;
            if o.get("num_adapters").and_then(Value::as_u64) != Some(adapters.len() as u64) {
                return Err("\"num_adapters\" does not count \"adapters\"".into());
            }
            if !adapters.iter().all(|a| a["status"].is_object()) {
                return Err("an adapter without a \"status\" object".into());
            }
            Ok(())
        }
        Expect::Operation(ops) => {
            if o.get("status").and_then(Value::as_str) != Some("ok") {
                return Err("no \"status\": \"ok\"".into());
            }
            match o.get("operation").and_then(Value::as_str) {
                Some(op) if ops.contains(&op) => Ok(()),
                _ => Err(format!("no \"operation\" of {ops:?}")),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn server_values() {
        for ok in [
            "127.0.0.1:8765",
            "http://127.0.0.1:8765",
            "HTTP://localhost:1/",
            "[::1]:8765",
            " kv.internal:80 ",
        ] {
            assert!(parse_server(ok).is_ok(), "{ok}");
        }
        assert_eq!(parse_server("http://[::1]:8/").unwrap(), "[::1]:8");
        for (bad, says) in [
            ("https://127.0.0.1:8765", "https:// is not supported"),
            ("unix:///run/daxkv.sock", "unix:// is not supported"),
            ("127.0.0.1:8765/reconfigure", "has a path (/reconfigure)"),
            ("http://127.0.0.1:8765/x/", "has a path (/x)"),
            ("/run/daxkv.sock", "is a path"),
            ("127.0.0.1:8765?x=1", "query"),
            ("user:pw@127.0.0.1:8765", "user info"),
            ("localhost", "no port"),
            ("::1", "no port"),
            ("127.0.0.1:", "bad port"),
            ("127.0.0.1:0", "bad port"),
            ("127.0.0.1:99999", "bad port"),
            ("", "empty"),
        ] {
            let e = parse_server(bad).unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
            assert!(e.starts_with("--server "), "{e}");
        }
    }

    #[test]
    fn answers() {
        assert_eq!(
            parse_answer(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}xx").unwrap(),
            (200, "{}".into())
        );
        assert_eq!(
            parse_answer(
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n4\r\nWiki\r\n5\r\npedia\r\n0\r\n\r\n"
            )
            .unwrap(),
            (200, "Wikipedia".into())
        );
        assert_eq!(
            parse_answer(b"HTTP/1.0 404 x\r\n\r\nnope").unwrap(),
            (404, "nope".into())
        );
        for bad in [
            &b""[..],
            b"SSH-2.0-OpenSSH\r\n",
            b"garbage\r\n\r\n",
            b"HTTP/1.1 2000 OK\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n{}",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nWi",
        ] {
            assert!(
                parse_answer(bad).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn shapes() {
        let st = json!({"enabled": true, "backend": "dax", "num_adapters": 1,
                        "adapters": [{"status": {"devices": []}}]});
        assert!(check_answer(Expect::Status, &st).is_ok());
        for bad in [
            json!({}),
            json!("ok"),
            json!({"backend": "dax", "num_adapters": 2, "adapters": [{"status": {}}]}),
            json!({"backend": "x", "num_adapters": 0, "adapters": []}),
            json!({"backend": "dax", "num_adapters": 1, "adapters": [1]}),
        ] {
            assert!(check_answer(Expect::Status, &bad).is_err(), "{bad}");
        }
        let rm = Expect::Operation(&["remove", "drain"]);
        assert!(check_answer(rm, &json!({"status": "ok", "operation": "drain"})).is_ok());
        for bad in [
            json!({"ok": true}),
            json!({"status": "ok", "operation": "add"}),
            json!({"status": "error", "operation": "remove"}),
            json!([]),
        ] {
            assert!(check_answer(rm, &bad).is_err(), "{bad}");
        }
    }
}
