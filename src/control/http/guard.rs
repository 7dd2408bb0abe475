//! # Browser guards: `Host`, `Origin`, `Sec-Fetch-Site`, `Content-Type`
//!
//! A web page open in a browser on the same host can send requests to a
//! loopback port: a form or an untyped `fetch` posts without a CORS
//! preflight (cross-site request forgery), and a name the attacker's DNS
//! points at 127.0.0.1 makes the page same-origin with the server (DNS
//! rebinding). Neither needs the token when none is set. The guards:
//!
//! | check | where | refused with |
//! |---|---|---|
//! | two `Host` headers | every route but `/health` | 400 |
//! | no `Host` on HTTP/1.1 (RFC 9112, section 3.2) | every route but `/health` | 400 |
//! | no `Host` on HTTP/1.0 | — | allowed: every browser sends `Host`, so a request without one is not a browser's, and a client that is not a browser can send any `Host` anyway |
//! | `Host` (and an absolute-form target's authority) not an allowed authority | every route but `/health` | 403 |
//! | `Origin` present and not `http://` + an allowed authority (`null` included) | every route but `/health` | 403 |
//! | `Sec-Fetch-Site: cross-site` or `same-site` | every route but `/health` | 403 |
//! | `Content-Type` missing, repeated, or not `application/json` (parameters allowed) | every `POST` (all mutate) | 415 |
//!
//! Allowed authorities: `127.0.0.1`, `[::1]` and `localhost` at the
//! listening port, the listening address itself when it is not a wildcard,
//! and [`HttpConfig::allow_hosts`](super::HttpConfig::allow_hosts). A
//! `Host` without a port means port 80. `/health` answers everyone, as it
//! does without the token: its answer tells nothing, and probes address a
//! server by whatever name they have.
//!
//! A JSON `Content-Type` cannot be sent cross-site without a CORS
//! preflight, which this server never grants (an `OPTIONS` is 405 without
//! CORS headers). FastAPI parses a body without `Content-Type` as JSON
//! (and one sent as `text/plain` as no body): here both are 415.

use std::net::SocketAddr;

use axum::http::{header, HeaderMap, StatusCode, Uri, Version};

/// The authorities (`host`, `port`) a request may name; hosts are lower
/// case, IPv6 without brackets.
#[derive(Debug, Clone)]
pub(crate) struct Hosts {
    allowed: Vec<(String, u16)>,
}

/// `host[:port]` split, the host lower-cased and unbracketed; `None` when
/// it is not a plain authority (userinfo, a path, bad characters, a bad
/// port). `bare_v6`: accept an unbracketed IPv6 address (config entries
/// only; a `Host` header brackets it).
fn split_authority(s: &str, bare_v6: bool) -> Option<(String, Option<u16>)> {
    let port = |p: &str| -> Option<u16> {
        if p.is_empty() || p.len() > 5 || !p.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        p.parse().ok()
    };
    if let Some(rest) = s.strip_prefix('[') {
        let (h, after) = rest.split_once(']')?;
        h.parse::<std::net::Ipv6Addr>().ok()?;
        let p = match after {
            "" => None,
            a => Some(port(a.strip_prefix(':')?)?),
        };
        return Some((h.to_ascii_lowercase(), p));
    }
    if bare_v6 && s.parse::<std::net::Ipv6Addr>().is_ok() {
        return Some((s.to_ascii_lowercase(), None));
    }
    let (h, p) = match s.split_once(':') {
        Some((h, p)) => (h, Some(port(p)?)),
        None => (s, None),
    };
    let name_ok = !h.is_empty()
        && h.len() <= 253
        && h.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-' || b == b'_');
    name_ok.then(|| (h.to_ascii_lowercase(), p))
}

impl Hosts {
    /// The authorities for a server listening on `listen` (its real port),
    /// plus `extra` (checked: an entry that is no authority is an error
    /// naming it).
    pub(crate) fn new(listen: SocketAddr, extra: &[String]) -> Result<Hosts, String> {
        let port = listen.port();
        let mut allowed = vec![
            ("127.0.0.1".to_string(), port),
            ("::1".to_string(), port),
            ("localhost".to_string(), port),
        ];
        if !listen.ip().is_unspecified() {
            allowed.push((listen.ip().to_string(), port));
        }
        for e in extra {
            let (h, p) = split_authority(e.trim(), true).ok_or_else(|| {
                format!("allow_hosts: {e:?} is not a host name, IP address or host:port")
            })?;
            allowed.push((h, p.unwrap_or(port)));
        }
        Ok(Hosts { allowed })
    }

    /// Whether an authority as a request names it (`Host`, or an
    /// `Origin`'s after `http://`) is one of ours.
    pub(crate) fn allows(&self, authority: &str) -> bool {
        let Some((h, p)) = split_authority(authority, false) else {
            return false;
        };
        let p = p.unwrap_or(80);
        // IPv4 spelled oddly (`127.1`, `0x7f.0.0.1`) is not accepted:
        // browsers normalize it, so only non-browsers send it.
        self.allowed.iter().any(|(ah, ap)| *ap == p && *ah == h)
    }
}

/// Why a request was refused: the status and a fixed message (the input
/// is never echoed).
pub(crate) type Refused = (StatusCode, &'static str);

const HOST_REFUSED: &str =
    "Host not allowed: use 127.0.0.1, [::1] or localhost with the server's port (or a name given with --allow-host)";
const ORIGIN_REFUSED: &str = "cross-site request refused (Origin)";
const FETCH_SITE_REFUSED: &str = "cross-site request refused (Sec-Fetch-Site)";

/// The `Host` / `Origin` / `Sec-Fetch-Site` rules (module docs) for a
/// request to `path`.
pub(crate) fn check_request(
    hosts: &Hosts,
    version: Version,
    uri: &Uri,
    headers: &HeaderMap,
) -> Result<(), Refused> {
    if uri.path() == "/health" {
        return Ok(());
    }
    let mut host_values = headers.get_all(header::HOST).iter();
    match (host_values.next(), host_values.next()) {
        (Some(_), Some(_)) => return Err((StatusCode::BAD_REQUEST, "more than one Host header")),
        (None, _) => {
            if version != Version::HTTP_10 && version != Version::HTTP_09 {
                return Err((StatusCode::BAD_REQUEST, "missing Host header"));
            }
        }
        (Some(h), None) => {
            if !h.to_str().is_ok_and(|h| hosts.allows(h)) {
                return Err((StatusCode::FORBIDDEN, HOST_REFUSED));
            }
        }
    }
    if let Some(a) = uri.authority() {
        if uri.scheme_str().is_some_and(|s| s != "http") || !hosts.allows(a.as_str()) {
            return Err((StatusCode::FORBIDDEN, HOST_REFUSED));
        }
    }
    for o in headers.get_all(header::ORIGIN) {
        let ok = o.to_str().ok().and_then(|o| {
            let (scheme, rest) = o.split_once("://")?;
            scheme
                .eq_ignore_ascii_case("http")
                .then(|| hosts.allows(rest))
        });
        if ok != Some(true) {
            return Err((StatusCode::FORBIDDEN, ORIGIN_REFUSED));
        }
    }
    for s in headers.get_all("sec-fetch-site") {
        let v = s.as_bytes();
        if v.eq_ignore_ascii_case(b"cross-site") || v.eq_ignore_ascii_case(b"same-site") {
            return Err((StatusCode::FORBIDDEN, FETCH_SITE_REFUSED));
        }
    }
    Ok(())
}

/// The message of a refused `Content-Type`.
pub(crate) const CONTENT_TYPE_REFUSED: &str = "Content-Type must be application/json";

/// Whether a mutating request declares exactly one JSON `Content-Type`.
pub(crate) fn json_content_type(headers: &HeaderMap) -> bool {
    let mut values = headers.get_all(header::CONTENT_TYPE).iter();
    let (Some(v), None) = (values.next(), values.next()) else {
        return false;
    };
    let Ok(v) = v.to_str() else {
        return false;
    };
    let media = v.split(';').next().unwrap_or_default().trim();
    media.eq_ignore_ascii_case("application/json")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(extra: &[&str]) -> Hosts {
        let extra: Vec<String> = extra.iter().map(|s| (*s).to_string()).collect();
        Hosts::new("127.0.0.1:8765".parse().unwrap(), &extra).unwrap()
    }

    #[test]
    fn host_authorities() {
        let h = hosts(&[]);
        for ok in [
            "127.0.0.1:8765",
            "localhost:8765",
            "LocalHost:8765",
            "[::1]:8765",
        ] {
            assert!(h.allows(ok), "{ok}");
        }
        for bad in [
            "127.0.0.1",
            "127.0.0.1:8766",
            "localhost",
            "evil.example:8765",
            "localhost.:8765",
            "127.1:8765",
            "::1:8765",
            "[::1]",
            "[::2]:8765",
            "user@127.0.0.1:8765",
            "127.0.0.1:8765/x",
            "127.0.0.1:08765x",
            "127.0.0.1:",
            "",
            "[::1]:8765:1",
        ] {
            assert!(!h.allows(bad), "{bad}");
        }
        let h = hosts(&["kv.internal", "10.0.0.5:9000", "fe80::1", "[fe80::2]:1"]);
        assert!(h.allows("kv.internal:8765"));
        assert!(h.allows("KV.internal:8765"));
        assert!(!h.allows("kv.internal:9000"));
        assert!(h.allows("10.0.0.5:9000"));
        assert!(!h.allows("10.0.0.5:8765"));
        assert!(h.allows("[fe80::1]:8765"));
        assert!(h.allows("[fe80::2]:1"));
        // Port 80 is the default of a Host without one.
        let h = Hosts::new("127.0.0.1:80".parse().unwrap(), &[]).unwrap();
        assert!(h.allows("localhost"));
        // The listening address itself, when it is one.
        let h = Hosts::new("10.1.2.3:7000".parse().unwrap(), &[]).unwrap();
        assert!(h.allows("10.1.2.3:7000"));
        let h = Hosts::new("0.0.0.0:7000".parse().unwrap(), &[]).unwrap();
        assert!(!h.allows("0.0.0.0:7000"));
        for bad in ["", "a b", "x:y", "[::1", "http://x", "x/y"] {
            assert!(
                Hosts::new("127.0.0.1:1".parse().unwrap(), &[bad.to_string()]).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn content_types() {
        let ct = |v: &[&str]| {
            let mut h = HeaderMap::new();
            for v in v {
                h.append(header::CONTENT_TYPE, v.parse().unwrap());
            }
            json_content_type(&h)
        };
        assert!(ct(&["application/json"]));
        assert!(ct(&["Application/JSON; charset=utf-8"]));
        assert!(ct(&[" application/json ;"]));
        assert!(!ct(&[]));
        assert!(!ct(&["text/plain"]));
        assert!(!ct(&["application/x-www-form-urlencoded"]));
        assert!(!ct(&["multipart/form-data; boundary=x"]));
        assert!(!ct(&["application/jsonx"]));
        assert!(!ct(&["application/json", "application/json"]));
    }
}
