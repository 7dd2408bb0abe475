//! The request bodies of `POST /reconfigure/...`: LMCache's strict pydantic
//! models for `dax`, the permissive `{adapter_index, ...}` for other
//! backends, and FastAPI's 422 `{"detail": [...]}` error items
//! (docs/lmcache-dax-behavior.md §5.2, §5.4).

use serde_json::{json, Map, Value};

use super::size::parse_size;

/// Why a body was refused before any backend saw it.
#[derive(Debug)]
pub(crate) enum Refusal {
    /// 400 "unsupported dax reconfigure operation: <op>".
    Unsupported,
    /// 422 with these `detail` items.
    Invalid(Vec<Value>),
    /// 400: the size is not a positive byte count (never echoed).
    BadSize,
}

/// A body that passed its schema.
#[derive(Debug)]
pub(crate) struct Accepted {
    /// The backend-local adapter index; `None` when negative or too large
    /// to be one (404 like any index out of range).
    pub local_index: Option<usize>,
    /// What the backend receives.
    pub payload: Value,
    /// For a DAX `add`: the path the allow-list checks.
    pub add_path: Option<String>,
}

/// The top-level keys of a JSON object body whose value is an integer
/// literal beyond `i64` / `u64`. serde_json reads such a literal as a
/// float; pydantic reads it as the (valid) integer it is, so a huge
/// `adapter_index` is a 404 and a huge `size` the 400 size message there,
/// not a 422 `int_type`.
#[derive(Debug, Default)]
pub(crate) struct BigInts(Vec<String>);

impl BigInts {
    /// Scan `body` (already parsed by serde_json, so valid JSON).
    pub(crate) fn scan(body: &[u8]) -> BigInts {
        let mut out = Vec::new();
        let mut i = skip_ws(body, 0);
        if body.get(i) != Some(&b'{') {
            return BigInts(out);
        }
        i += 1;
        loop {
            i = skip_ws(body, i);
            if body.get(i) != Some(&b'"') {
                break; // `}`: the end
            }
            let key_end = string_end(body, i);
            let key: Option<String> = serde_json::from_slice(&body[i..key_end]).ok();
            i = skip_ws(body, key_end) + 1; // past `:`
            i = skip_ws(body, i);
            let start = i;
            i = value_end(body, i);
            let raw = &body[start..i.min(body.len())];
            let integer = !raw.is_empty()
                && raw
                    .iter()
                    .enumerate()
                    .all(|(j, &b)| b.is_ascii_digit() || (j == 0 && b == b'-'));
            if integer {
                let fits =
                    serde_json::from_slice::<Value>(raw).is_ok_and(|v| v.is_i64() || v.is_u64());
                if let (false, Some(k)) = (fits, key) {
                    out.push(k);
                }
            }
            i = skip_ws(body, i);
            if body.get(i) != Some(&b',') {
                break;
            }
            i += 1;
        }
        BigInts(out)
    }

    fn has(&self, key: &str) -> bool {
        self.0.iter().any(|k| k == key)
    }
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while b.get(i).is_some_and(u8::is_ascii_whitespace) {
        i += 1;
    }
    i
}

/// The index past the string starting at `b[i] == '"'`.
fn string_end(b: &[u8], mut i: usize) -> usize {
    i += 1;
    while let Some(&c) = b.get(i) {
        match c {
            b'\\' => i += 2,
            b'"' => return i + 1,
            _ => i += 1,
        }
    }
    b.len()
}

/// The index past the JSON value starting at `b[i]`.
fn value_end(b: &[u8], mut i: usize) -> usize {
    let mut depth = 0usize;
    while let Some(&c) = b.get(i) {
        match c {
            b'"' => {
                i = string_end(b, i);
                if depth == 0 {
                    return i;
                }
                continue;
            }
            b'{' | b'[' => depth += 1,
            b'}' | b']' => {
                if depth == 0 {
                    return i;
                }
                depth -= 1;
                if depth == 0 {
                    return i + 1;
                }
            }
            b',' if depth == 0 => return i,
            c if depth == 0 && c.is_ascii_whitespace() => return i,
            _ => {}
        }
        i += 1;
    }
    b.len()
}

/// One FastAPI / pydantic v2 error item.
pub(crate) fn item(ty: &str, loc: &[&str], msg: &str, input: &Value) -> Value {
    let mut l = vec![Value::from("body")];
    l.extend(loc.iter().map(|s| Value::from(*s)));
    json!({ "type": ty, "loc": l, "msg": msg, "input": input })
}

/// The 422 items for a body that is not JSON (`json_invalid`, at the
/// byte offset of the error) or is empty (`missing`).
pub(crate) fn json_error(body: &[u8], e: &serde_json::Error) -> Value {
    if body.iter().all(u8::is_ascii_whitespace) {
        return json!({"type": "missing", "loc": ["body"], "msg": "Field required", "input": null});
    }
    // serde_json reports 1-based line and column; FastAPI a 0-based
    // position.
    let line_start: usize = body
        .split(|&b| b == b'\n')
        .take(e.line().saturating_sub(1))
        .map(|l| l.len() + 1)
        .sum();
    let pos = (line_start + e.column()).saturating_sub(1);
    let what = match e.classify() {
        serde_json::error::Category::Eof => "unexpected end of input",
        _ => "invalid JSON",
    };
    json!({
        "type": "json_invalid",
        "loc": ["body", pos],
        "msg": "JSON decode error",
        "input": {},
        "ctx": {"error": what},
    })
}

fn object<'a>(body: &'a Value, out: &mut Vec<Value>) -> Option<&'a Map<String, Value>> {
    let o = body.as_object();
    if o.is_none() {
        out.push(json!({
            "type": "model_attributes_type",
            "loc": ["body"],
            "msg": "Input should be a valid dictionary or object to extract fields from",
            "input": body,
        }));
    }
    o
}

/// `adapter_index: int = 0` (a JSON integer; a bool or a float is 422;
/// an integer beyond `u64` is out of range).
fn adapter_index(o: &Map<String, Value>, big: &BigInts, out: &mut Vec<Value>) -> Option<usize> {
    match o.get("adapter_index") {
        None => Some(0),
        Some(v) if v.is_i64() || v.is_u64() => v.as_u64().and_then(|i| usize::try_from(i).ok()),
        Some(Value::Number(_)) if big.has("adapter_index") => None,
        Some(v) => {
            out.push(item(
                "int_type",
                &["adapter_index"],
                "Input should be a valid integer",
                v,
            ));
            None
        }
    }
}

/// A generic backend's body: `{adapter_index = 0, ...}`, the rest
/// forwarded unchanged.
pub(crate) fn generic(body: &Value, big: &BigInts) -> Result<Accepted, Refusal> {
    let mut errs = Vec::new();
    let Some(o) = object(body, &mut errs) else {
        return Err(Refusal::Invalid(errs));
    };
    let local_index = adapter_index(o, big, &mut errs);
    if !errs.is_empty() {
        return Err(Refusal::Invalid(errs));
    }
    let mut payload = o.clone();
    payload.remove("adapter_index");
    Ok(Accepted {
        local_index,
        payload: Value::Object(payload),
        add_path: None,
    })
}

/// The DAX operations and their fields (beyond `adapter_index`).
fn dax_fields(op: &str) -> Option<&'static [&'static str]> {
    Some(match op {
        "add" => &["device_path", "size", "max_size", "create"],
        "remove" => &["device_path", "device_index", "mode", "force"],
        "resize" => &["device_path", "device_index", "size", "mode", "force"],
        _ => return None,
    })
}

/// A DAX body for `op` (normalized): the strict models of
/// docs/lmcache-dax-behavior.md §5.4, then the size grammar, into the
/// payload `DaxL2Adapter.reconfigure` expects.
pub(crate) fn dax(op: &str, body: &Value, big: &BigInts) -> Result<Accepted, Refusal> {
    let fields = dax_fields(op).ok_or(Refusal::Unsupported)?;
    let mut errs = Vec::new();
    let Some(o) = object(body, &mut errs) else {
        return Err(Refusal::Invalid(errs));
    };
    let local_index = adapter_index(o, big, &mut errs);
    let mut payload = Map::new();

    device(fields, body, o, &mut payload, &mut errs);

    // `size: StrictInt | str`, converted after the schema passes.
    let mut size = None;
    // An integer beyond u64: valid for the schema, then not a byte count.
    let mut size_too_big = false;
    if fields.contains(&"size") {
        match o.get("size") {
            None => errs.push(item("missing", &["size"], "Field required", body)),
            Some(v @ Value::Number(n)) if n.is_i64() || n.is_u64() => size = Some(v),
            Some(Value::Number(_)) if big.has("size") => size_too_big = true,
            Some(v @ Value::String(_)) => size = Some(v),
            Some(v) => {
                // pydantic's smart union reports both members.
                errs.push(item(
                    "int_type",
                    &["size", "int"],
                    "Input should be a valid integer",
                    v,
                ));
                errs.push(item(
                    "string_type",
                    &["size", "str"],
                    "Input should be a valid string",
                    v,
                ));
            }
        }
    }

    let max_size = if fields.contains(&"max_size") {
        max_size_field(o, &mut errs)
    } else {
        None
    };

    if fields.contains(&"mode") {
        mode(op, o, &mut payload, &mut errs);
    }
    if fields.contains(&"force") {
        force(o, &mut payload, &mut errs);
    }
    if fields.contains(&"create") {
        create(o, &mut payload, &mut errs);
    }

    for (k, v) in o {
        if k != "adapter_index" && !fields.contains(&k.as_str()) {
            errs.push(item(
                "extra_forbidden",
                &[k.as_str()],
                "Extra inputs are not permitted",
                v,
            ));
        }
    }
    if !errs.is_empty() {
        return Err(Refusal::Invalid(errs));
    }

    if size_too_big {
        return Err(Refusal::BadSize);
    }
    if let Some(v) = size {
        let bytes = match v {
            Value::String(s) => parse_size(s),
            v => v.as_u64().filter(|&b| b > 0),
        };
        payload.insert("size_bytes".into(), bytes.ok_or(Refusal::BadSize)?.into());
    }
    if let Some(v) = max_size {
        payload.insert("max_size_bytes".into(), max_size_bytes(v));
    }
    let add_path = (op == "add")
        .then(|| {
            payload
                .get("device_path")
                .and_then(Value::as_str)
                .map(str::to_owned)
        })
        .flatten();
    Ok(Accepted {
        local_index,
        payload: Value::Object(payload),
        add_path,
    })
}

/// The device an operation names: `device_path: str`, or (remove,
/// resize) daxkv's `device_index`, or both.
fn device(
    fields: &[&str],
    body: &Value,
    o: &Map<String, Value>,
    payload: &mut Map<String, Value>,
    errs: &mut Vec<Value>,
) {
    let by_index = fields.contains(&"device_index") && device_index(o, payload, errs);
    match o.get("device_path") {
        None if by_index => {}
        None => errs.push(item("missing", &["device_path"], "Field required", body)),
        Some(Value::String(p)) => {
            payload.insert("device_path".into(), Value::String(p.clone()));
        }
        Some(v) => errs.push(item(
            "string_type",
            &["device_path"],
            "Input should be a valid string",
            v,
        )),
    }
}

/// `force: bool = False` (pydantic's lax bool).
fn force(o: &Map<String, Value>, payload: &mut Map<String, Value>, errs: &mut Vec<Value>) {
    match o.get("force").map(lax_bool) {
        None => {
            payload.insert("force".into(), false.into());
        }
        Some(Ok(b)) => {
            payload.insert("force".into(), b.into());
        }
        Some(Err((ty, msg))) => errs.push(item(ty, &["force"], msg, &o["force"])),
    }
}

/// daxkv's `create: bool = False` (add; pydantic's lax bool): create a
/// missing file. Passed on only when true, so that the backend sees
/// LMCache's payload otherwise.
fn create(o: &Map<String, Value>, payload: &mut Map<String, Value>, errs: &mut Vec<Value>) {
    match o.get("create").map(lax_bool) {
        None | Some(Ok(false)) => {}
        Some(Ok(true)) => {
            payload.insert("create".into(), true.into());
        }
        Some(Err((ty, msg))) => errs.push(item(ty, &["create"], msg, &o["create"])),
    }
}

/// `max_size: StrictInt | str | None` (add): the largest size a later
/// resize may grow the device to.
fn max_size_field<'a>(o: &'a Map<String, Value>, errs: &mut Vec<Value>) -> Option<&'a Value> {
    match o.get("max_size") {
        None | Some(Value::Null) => None,
        Some(v @ Value::Number(n)) if n.is_i64() || n.is_u64() => Some(v),
        Some(v @ Value::String(_)) => Some(v),
        Some(v) => {
            errs.push(item(
                "int_type",
                &["max_size", "int"],
                "Input should be a valid integer",
                v,
            ));
            None
        }
    }
}

/// daxkv's `device_index: int | None` (remove, resize): the device at that
/// position of the status list; `device_path` may then be left out.
/// Whether one was given.
fn device_index(
    o: &Map<String, Value>,
    payload: &mut Map<String, Value>,
    errs: &mut Vec<Value>,
) -> bool {
    match o.get("device_index") {
        None | Some(Value::Null) => false,
        Some(v) if v.is_u64() => {
            payload.insert("device_index".into(), v.clone());
            true
        }
        Some(v) => {
            errs.push(item(
                "int_type",
                &["device_index"],
                "Input should be a valid non-negative integer",
                v,
            ));
            false
        }
    }
}

/// A `max_size` in bytes; a bad value goes on as it is, for the backend
/// to refuse by name.
fn max_size_bytes(v: &Value) -> Value {
    let bytes = match v {
        Value::String(s) => parse_size(s),
        v => v.as_u64().filter(|&b| b > 0),
    };
    bytes.map_or_else(|| v.clone(), Value::from)
}

/// `mode: Literal[...] = "migrate"` (`drain` for `remove` only).
fn mode(op: &str, o: &Map<String, Value>, payload: &mut Map<String, Value>, errs: &mut Vec<Value>) {
    let modes: &[&str] = if op == "remove" {
        &["migrate", "evict", "drain"]
    } else {
        &["migrate", "evict"]
    };
    match o.get("mode") {
        None => {
            payload.insert("mode".into(), "migrate".into());
        }
        Some(Value::String(m)) if modes.contains(&m.as_str()) => {
            payload.insert("mode".into(), Value::String(m.clone()));
        }
        Some(v) => {
            let expected = if op == "remove" {
                "'migrate', 'evict' or 'drain'"
            } else {
                "'migrate' or 'evict'"
            };
            let mut e = item(
                "literal_error",
                &["mode"],
                &format!("Input should be {expected}"),
                v,
            );
            e["ctx"] = json!({ "expected": expected });
            errs.push(e);
        }
    }
}

/// pydantic's lax `bool`: booleans, 0 / 1, and the usual words.
fn lax_bool(v: &Value) -> Result<bool, (&'static str, &'static str)> {
    const UNPARSED: (&str, &str) = (
        "bool_parsing",
        "Input should be a valid boolean, unable to interpret input",
    );
    match v {
        Value::Bool(b) => Ok(*b),
        Value::Number(n) => match n.as_u64() {
            Some(0) => Ok(false),
            Some(1) => Ok(true),
            _ => Err(UNPARSED),
        },
        Value::String(s) => match s.to_ascii_lowercase().as_str() {
            "0" | "off" | "f" | "false" | "n" | "no" => Ok(false),
            "1" | "on" | "t" | "true" | "y" | "yes" => Ok(true),
            _ => Err(UNPARSED),
        },
        _ => Err(("bool_type", "Input should be a valid boolean")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn invalid(op: &str, body: &Value) -> Vec<Value> {
        match dax(op, body, &BigInts::default()) {
            Err(Refusal::Invalid(e)) => e,
            other => panic!("{op} {body}: {other:?}"),
        }
    }

    fn types(errs: &[Value]) -> Vec<(&str, Vec<&str>)> {
        errs.iter()
            .map(|e| {
                (
                    e["type"].as_str().unwrap(),
                    e["loc"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|l| l.as_str().unwrap_or("#"))
                        .collect(),
                )
            })
            .collect()
    }

    #[test]
    fn dax_payloads() {
        let a = dax(
            "add",
            &json!({"device_path": "/dev/dax0.0", "size": "2GiB"}),
            &BigInts::default(),
        )
        .unwrap();
        assert_eq!(
            a.payload,
            json!({"device_path": "/dev/dax0.0", "size_bytes": 2_147_483_648u64})
        );
        assert_eq!(a.local_index, Some(0));
        assert_eq!(a.add_path.as_deref(), Some("/dev/dax0.0"));
        // daxkv's `create`: passed on when true, left out otherwise (the
        // backend then sees LMCache's payload), a non-bool refused.
        for (create, passed) in [(json!(true), Some(true)), (json!("no"), None)] {
            let a = dax(
                "add",
                &json!({"device_path": "p", "size": 4096, "create": create}),
                &BigInts::default(),
            )
            .unwrap();
            assert_eq!(a.payload.get("create").and_then(Value::as_bool), passed);
        }
        let e = invalid(
            "add",
            &json!({"device_path": "p", "size": 4096, "create": "maybe"}),
        );
        assert_eq!(types(&e), [("bool_parsing", vec!["body", "create"])]);
        let r = dax(
            "remove",
            &json!({"device_path": "p", "adapter_index": 2}),
            &BigInts::default(),
        )
        .unwrap();
        assert_eq!(
            r.payload,
            json!({"device_path": "p", "mode": "migrate", "force": false})
        );
        assert_eq!(r.local_index, Some(2));
        assert!(r.add_path.is_none());
        let r = dax(
            "resize",
            &json!({"device_path": "p", "size": 4096, "mode": "evict", "force": "yes"}),
            &BigInts::default(),
        )
        .unwrap();
        assert_eq!(
            r.payload,
            json!({"device_path": "p", "size_bytes": 4096, "mode": "evict", "force": true})
        );
        let r = dax(
            "remove",
            &json!({"device_path": "p", "mode": "drain", "force": 1}),
            &BigInts::default(),
        )
        .unwrap();
        assert_eq!(r.payload["mode"], "drain");
        assert_eq!(r.payload["force"], true);
        assert_eq!(
            dax(
                "add",
                &json!({"adapter_index": -1, "device_path": "p", "size": 1}),
                &BigInts::default()
            )
            .unwrap()
            .local_index,
            None
        );
    }

    #[test]
    fn dax_422s() {
        let e = invalid("add", &json!({"device_path": "p", "size_bytes": 4096}));
        assert_eq!(
            types(&e),
            [
                ("missing", vec!["body", "size"]),
                ("extra_forbidden", vec!["body", "size_bytes"])
            ]
        );
        let e = invalid("add", &json!({"device_path": "p", "size": true}));
        assert_eq!(
            types(&e),
            [
                ("int_type", vec!["body", "size", "int"]),
                ("string_type", vec!["body", "size", "str"])
            ]
        );
        invalid("add", &json!({"device_path": "p", "size": 4096.0}));
        invalid("add", &json!({"device_path": "p", "size": null}));
        let e = invalid(
            "resize",
            &json!({"device_path": "p", "size": 1, "mode": "drain"}),
        );
        assert_eq!(types(&e), [("literal_error", vec!["body", "mode"])]);
        assert_eq!(e[0]["ctx"]["expected"], "'migrate' or 'evict'");
        let e = invalid("remove", &json!({"device_path": "p", "timeout_s": 5}));
        assert_eq!(types(&e), [("extra_forbidden", vec!["body", "timeout_s"])]);
        let e = invalid("add", &json!({"size": 1}));
        assert_eq!(types(&e), [("missing", vec!["body", "device_path"])]);
        assert_eq!(e[0]["input"], json!({"size": 1}));
        let e = invalid(
            "remove",
            &json!({"device_path": 3, "force": "maybe", "adapter_index": true}),
        );
        assert_eq!(
            types(&e),
            [
                ("int_type", vec!["body", "adapter_index"]),
                ("string_type", vec!["body", "device_path"]),
                ("bool_parsing", vec!["body", "force"]),
            ]
        );
        let e = invalid("add", &json!([1, 2]));
        assert_eq!(types(&e), [("model_attributes_type", vec!["body"])]);
    }

    #[test]
    fn sizes_and_unsupported() {
        for bad in [
            json!("many"),
            json!(0),
            json!(-5),
            json!(""),
            json!("x".repeat(1000)),
        ] {
            assert!(
                matches!(
                    dax(
                        "add",
                        &json!({"device_path": "p", "size": bad}),
                        &BigInts::default()
                    ),
                    Err(Refusal::BadSize)
                ),
                "{bad}"
            );
        }
        assert!(matches!(
            dax("status", &json!({}), &BigInts::default()),
            Err(Refusal::Unsupported)
        ));
        assert!(matches!(
            dax("ADD", &json!({}), &BigInts::default()),
            Err(Refusal::Unsupported)
        ));
    }

    #[test]
    fn generic_bodies() {
        let a = generic(
            &json!({"adapter_index": 1, "x": [1], "adapter": "y"}),
            &BigInts::default(),
        )
        .unwrap();
        assert_eq!(a.payload, json!({"x": [1], "adapter": "y"}));
        assert_eq!(a.local_index, Some(1));
        assert!(matches!(
            generic(&json!("s"), &BigInts::default()),
            Err(Refusal::Invalid(_))
        ));
        assert!(matches!(
            generic(&json!({"adapter_index": "1"}), &BigInts::default()),
            Err(Refusal::Invalid(_))
        ));
    }

    #[test]
    fn big_integers() {
        let scan = |s: &str| {
            serde_json::from_str::<Value>(s).unwrap();
            BigInts::scan(s.as_bytes()).0
        };
        let big = "184467440737095516160000";
        assert_eq!(
            scan(&format!(
                r#"{{"size": {big}, "adapter_index": -{big}, "x": 1}}"#
            )),
            ["size", "adapter_index"]
        );
        assert!(scan(r#"{"size": 18446744073709551615, "a": -9223372036854775808}"#).is_empty());
        assert_eq!(scan(r#"{"a": -9223372036854775809}"#), ["a"]);
        // Floats, strings and nested values are not integer literals.
        assert!(scan(&format!(
            r#"{{"a": 1e30, "b": "{big}", "c": [{big}], "d": {{"e": {big}}}, "f": 1.0}}"#
        ))
        .is_empty());
        assert_eq!(
            scan(&format!(
                "{{ \"s\\\"\\u0041\" :\n{big} , \"t\" : {{\"}}\": 1}}, \"u\":{big}}}"
            )),
            ["s\"A", "u"]
        );
        assert!(scan("[1]").is_empty());
        assert!(scan("{}").is_empty());
        let e = BigInts::scan(format!(r#"{{"device_path": "p", "size": {big}}}"#).as_bytes());
        let body =
            serde_json::from_str::<Value>(&format!(r#"{{"device_path": "p", "size": {big}}}"#))
                .unwrap();
        assert!(matches!(dax("add", &body, &e), Err(Refusal::BadSize)));
        let body = serde_json::from_str::<Value>(&format!(
            r#"{{"device_path": "p", "adapter_index": {big}}}"#
        ))
        .unwrap();
        let e = BigInts::scan(body.to_string().as_bytes());
        assert_eq!(
            dax("remove", &body, &BigInts(vec!["adapter_index".into()]))
                .unwrap()
                .local_index,
            None
        );
        assert!(
            matches!(dax("remove", &body, &e), Err(Refusal::Invalid(_))),
            "a float is still 422"
        );
    }

    #[test]
    fn json_errors() {
        let bad = b"{\n \"a\": }";
        let e = serde_json::from_slice::<Value>(bad).unwrap_err();
        let v = json_error(bad, &e);
        assert_eq!(v["type"], "json_invalid");
        assert_eq!(v["loc"], json!(["body", 8]));
        let e = serde_json::from_slice::<Value>(b"").unwrap_err();
        assert_eq!(json_error(b"", &e)["type"], "missing");
    }
}
