//! etcd's v3 API through its JSON gateway (`/v3/kv/range`, `/v3/kv/txn`,
//! `/v3/lease/grant`, …), spoken with hyper's HTTP/1.1 client, over plain TCP or over
//! TLS (rustls, [`super::tls`]): the same operations and guarantees as its gRPC API
//! (linearizable reads, transactions, leases), without a protobuf toolchain in the build. Keys and values travel in base64, 64-bit numbers as
//! JSON strings, and fields equal to zero are left out; all three are handled here and
//! nowhere else.
//!
//! A request goes to the first endpoint that answers; a member that does not is tried
//! again only after the others. Every request has a deadline: a cut-off member costs
//! one deadline, never a hang.
//!
//! One file because it is one wire protocol: the client's requests and the wire types they
//! decode share the base64, string-number and omitted-zero rules above, kept in one place.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::Bytes;
use hyper::{Request, header};
use hyper_util::rt::TokioIo;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize};

use tokio_rustls::rustls::pki_types::ServerName;

use super::tls::{self, EtcdTls};
use crate::store::StoreError;

/// The largest answer read: a domain's whole ledger is a few hundred small keys.
const MAX_BODY_BYTES: usize = 8 * 1024 * 1024;

/// One key as etcd holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyValue {
    pub key: String,
    pub value: Vec<u8>,
    /// The revision that created the key (0: it does not exist).
    pub create_revision: i64,
    pub mod_revision: i64,
    /// The lease the key is bound to (0: none); the key goes when the lease does.
    pub lease: i64,
}

/// What a transaction compares before it acts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Compare {
    /// The key's create revision equals this one (0: the key does not exist).
    CreateRevision(String, i64),
    /// The key's last modification is this revision (0: the key does not exist).
    ModRevision(String, i64),
}

/// One operation of a transaction's branch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    Put {
        key: String,
        value: Vec<u8>,
        /// 0: not bound to a lease.
        lease: i64,
    },
    Delete {
        key: String,
    },
    /// Every key under the prefix.
    ListPrefix {
        prefix: String,
    },
}

/// A transaction: if every compare holds, `success` runs, else `failure`; atomically.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Txn {
    pub compare: Vec<Compare>,
    pub success: Vec<Op>,
    pub failure: Vec<Op>,
}

/// What a transaction did: which branch, and the keys its list operations read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TxnOutcome {
    pub succeeded: bool,
    /// The store's revision after the transaction.
    pub revision: i64,
    /// One list per `ListPrefix` of the branch that ran, in order.
    pub lists: Vec<Vec<KeyValue>>,
}

/// One member's client URL, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// `https://`: spoken over TLS.
    pub tls: bool,
    /// `host:port`: where to connect, and the request's `Host`.
    pub authority: String,
    /// The host alone (an IPv6 address without its brackets): the name etcd's server
    /// certificate must carry.
    pub host: String,
}

/// An etcd client URL (`http://HOST:PORT` or `https://HOST:PORT`), or why it is not one.
pub fn check_endpoint(url: &str) -> Result<Endpoint, String> {
    let (tls, rest) = if let Some(rest) = url.strip_prefix("http://") {
        (false, rest)
    } else if let Some(rest) = url.strip_prefix("https://") {
        (true, rest)
    } else {
        return Err(format!(
            "etcd endpoint `{url}` is not http://HOST:PORT or https://HOST:PORT (etcd's --advertise-client-urls)"
        ));
    };
    let authority = rest.trim_end_matches('/');
    let host = authority
        .rsplit_once(':')
        .filter(|(host, port)| {
            !host.is_empty() && !authority.contains('/') && port.parse::<u16>().is_ok()
        })
        .map(|(host, _)| host.trim_start_matches('[').trim_end_matches(']'))
        .filter(|host| !host.is_empty())
        .ok_or_else(|| {
            let scheme = if tls { "https" } else { "http" };
            format!("etcd endpoint `{url}` is not {scheme}://HOST:PORT")
        })?;
    Ok(Endpoint {
        tls,
        authority: authority.to_owned(),
        host: host.to_owned(),
    })
}

/// The cluster's client URLs, each checked, and all of one scheme: a cluster is spoken to
/// over TLS or not at all, never half.
pub fn check_endpoints(urls: &[String]) -> Result<Vec<Endpoint>, String> {
    if urls.is_empty() {
        return Err(
            "no etcd endpoint given: name the cluster's client URLs (http://HOST:2379, or https:// with TLS)"
                .into(),
        );
    }
    let endpoints = urls
        .iter()
        .map(|url| check_endpoint(url))
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(other) = endpoints.iter().position(|e| e.tls != endpoints[0].tls) {
        return Err(format!(
            "etcd endpoints `{}` and `{}` mix http:// and https://: a cluster is spoken to over TLS or not; write every member's URL with the scheme its --advertise-client-urls has",
            urls[0], urls[other]
        ));
    }
    Ok(endpoints)
}

/// A client of one etcd cluster through its JSON gateway.
#[derive(Debug)]
pub struct EtcdClient {
    endpoints: Vec<Endpoint>,
    /// Every endpoint's `host:port` (what [`Self::endpoints`] lists).
    authorities: Vec<String>,
    /// The TLS setup and each endpoint's server name, for https endpoints.
    tls: Option<(EtcdTls, Vec<ServerName<'static>>)>,
    /// The member that answered last: tried first.
    preferred: AtomicUsize,
    timeout: Duration,
    runtime: tokio::runtime::Runtime,
}

impl EtcdClient {
    /// A client of the members at `endpoints` (`http://HOST:PORT`, as etcd's
    /// `--advertise-client-urls` writes them), each request given `timeout`.
    pub fn new(endpoints: &[String], timeout: Duration) -> Result<Self, StoreError> {
        Self::with_tls(endpoints, None, timeout)
    }

    /// A client of the members at `endpoints`: `https://` ones need `tls` (the CA, and a
    /// client certificate where etcd asks for one), `http://` ones refuse it.
    pub fn with_tls(
        endpoints: &[String],
        tls: Option<&EtcdTls>,
        timeout: Duration,
    ) -> Result<Self, StoreError> {
        let checked = check_endpoints(endpoints).map_err(StoreError::Config)?;
        let tls = match (checked[0].tls, tls) {
            (true, None) => {
                return Err(StoreError::Config(format!(
                    "etcd endpoint `{}` is https:// but no CA is given: name the CA that signed etcd's server certificate (fleet.ca_file in serve.toml, --etcd-ca on the command line)",
                    endpoints[0]
                )));
            }
            (false, Some(_)) => {
                return Err(StoreError::Config(format!(
                    "TLS files are given but etcd endpoint `{}` is plain http://: write the https:// URLs etcd serves TLS on, or leave the TLS files out",
                    endpoints[0]
                )));
            }
            (false, None) => None,
            (true, Some(tls)) => {
                let names = checked
                    .iter()
                    .map(|e| {
                        ServerName::try_from(e.host.clone()).map_err(|_| {
                            StoreError::Config(format!(
                                "etcd endpoint host `{}` is neither a DNS name nor an IP address, so no certificate can name it",
                                e.host
                            ))
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                Some((tls.clone(), names))
            }
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .map_err(|e| {
                StoreError::Config(format!("cannot start the etcd client's runtime: {e}"))
            })?;
        Ok(Self {
            authorities: checked.iter().map(|e| e.authority.clone()).collect(),
            endpoints: checked,
            tls,
            preferred: AtomicUsize::new(0),
            timeout,
            runtime,
        })
    }

    /// Whether the client speaks TLS to the members.
    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// Every member's `host:port`.
    pub fn endpoints(&self) -> &[String] {
        &self.authorities
    }

    /// The key, read linearizably.
    pub fn get(&self, key: &str) -> Result<Option<KeyValue>, StoreError> {
        let answer: RangeAnswer = self.call("/v3/kv/range", &range_request(key, false))?;
        answer
            .kvs
            .into_iter()
            .next()
            .map(KeyValue::try_from)
            .transpose()
    }

    /// Every key under `prefix`, in key order, read linearizably.
    pub fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, StoreError> {
        let answer: RangeAnswer = self.call("/v3/kv/range", &range_request(prefix, true))?;
        answer.kvs.into_iter().map(KeyValue::try_from).collect()
    }

    pub fn put(&self, key: &str, value: &[u8], lease: i64) -> Result<(), StoreError> {
        let _: Ignored = self.call(
            "/v3/kv/put",
            &PutRequest {
                key: BASE64.encode(key),
                value: BASE64.encode(value),
                lease: lease.to_string(),
            },
        )?;
        Ok(())
    }

    pub fn txn(&self, txn: &Txn) -> Result<TxnOutcome, StoreError> {
        let request = TxnRequest {
            compare: txn.compare.iter().map(compare_json).collect(),
            success: txn.success.iter().map(op_json).collect(),
            failure: txn.failure.iter().map(op_json).collect(),
        };
        let answer: TxnAnswer = self.call("/v3/kv/txn", &request)?;
        let mut lists = Vec::new();
        for response in answer.responses {
            if let Some(range) = response.response_range {
                lists.push(
                    range
                        .kvs
                        .into_iter()
                        .map(KeyValue::try_from)
                        .collect::<Result<_, _>>()?,
                );
            }
        }
        Ok(TxnOutcome {
            succeeded: answer.succeeded,
            revision: answer.header.revision,
            lists,
        })
    }

    /// A new lease of `ttl` (whole seconds, at least one), and the TTL etcd gave it.
    pub fn grant_lease(&self, ttl: Duration) -> Result<(i64, Duration), StoreError> {
        let seconds = ttl.as_secs().max(1);
        let answer: LeaseAnswer = self.call(
            "/v3/lease/grant",
            &serde_json::json!({ "TTL": seconds.to_string() }),
        )?;
        if answer.id == 0 {
            return Err(StoreError::Protocol(
                "etcd granted a lease without an ID".into(),
            ));
        }
        Ok((
            answer.id,
            Duration::from_secs(u64::try_from(answer.ttl).unwrap_or(0)),
        ))
    }

    /// Renews the lease: the TTL it has now, or `None` where it has expired (or was
    /// revoked), after which every key bound to it is gone.
    pub fn keep_alive(&self, lease: i64) -> Result<Option<Duration>, StoreError> {
        let answer: KeepAliveAnswer = self.call(
            "/v3/lease/keepalive",
            &serde_json::json!({ "ID": lease.to_string() }),
        )?;
        let ttl = answer.result.map_or(0, |r| r.ttl);
        Ok((ttl > 0).then(|| Duration::from_secs(ttl.unsigned_abs())))
    }

    /// Ends the lease now: every key bound to it goes, atomically.
    pub fn revoke(&self, lease: i64) -> Result<(), StoreError> {
        match self.call::<Ignored, _>(
            "/v3/lease/revoke",
            &serde_json::json!({ "ID": lease.to_string() }),
        ) {
            Ok(_) => Ok(()),
            // Already gone is what was asked for.
            Err(StoreError::Etcd { code: 5, .. }) => Ok(()),
            Err(error) => Err(error),
        }
    }

    /// One POST, to the preferred member first, then the others in turn.
    fn call<T: DeserializeOwned, B: Serialize>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<T, StoreError> {
        let body = serde_json::to_vec(body).map_err(|e| {
            StoreError::Protocol(format!("cannot encode the request to {path}: {e}"))
        })?;
        let first = self.preferred.load(Ordering::Relaxed) % self.endpoints.len();
        let mut unreachable = Vec::new();
        for offset in 0..self.endpoints.len() {
            let index = (first + offset) % self.endpoints.len();
            let endpoint = &self.endpoints[index].authority;
            let tls = self
                .tls
                .as_ref()
                .map(|(tls, names)| (tls.connector(), names[index].clone()));
            let answer = self.runtime.block_on(async {
                tokio::time::timeout(self.timeout, post(endpoint, tls, path, body.clone())).await
            });
            match answer {
                Ok(Ok((status, bytes))) => {
                    self.preferred.store(index, Ordering::Relaxed);
                    return decode(endpoint, path, status, &bytes);
                }
                Ok(Err(why)) => unreachable.push(format!("{endpoint}: {why}")),
                Err(_) => {
                    unreachable.push(format!("{endpoint}: no answer within {:?}", self.timeout))
                }
            }
        }
        Err(StoreError::Unavailable(unreachable.join("; ")))
    }
}

async fn post(
    endpoint: &str,
    tls: Option<(tokio_rustls::TlsConnector, ServerName<'static>)>,
    path: &str,
    body: Vec<u8>,
) -> Result<(u16, Bytes), String> {
    let stream = tokio::net::TcpStream::connect(endpoint)
        .await
        .map_err(|e| format!("cannot connect: {e}"))?;
    match tls {
        None => exchange(stream, endpoint, path, body)
            .await
            .map_err(|why| {
                // A TLS member closes a plain request without a word.
                if why.contains("closed before message completed") {
                    format!(
                        "{why} (if the member serves TLS, its client URL is https:// and a CA is needed)"
                    )
                } else {
                    why
                }
            }),
        Some((connector, name)) => {
            let stream = connector
                .connect(name, stream)
                .await
                .map_err(|e| {
                    let what = format!("TLS handshake failed: {e}");
                    // A plain member answers a ClientHello by closing the connection or,
                    // as often, by resetting it (seen on etcd 3.5 under load).
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset
                    ) {
                        format!(
                            "{what} (the member closed the connection: it most likely does not speak TLS on this port; is its client URL http:// rather than https://?)"
                        )
                    } else {
                        with_hint(&what, &e)
                    }
                })?;
            exchange(stream, endpoint, path, body).await
        }
    }
}

/// `what`, and what to do about it where the error is one an operator's TLS setup causes.
fn with_hint(what: &str, error: &(dyn std::error::Error + 'static)) -> String {
    match tls::hint(error) {
        Some(hint) => format!("{what} ({hint})"),
        None => what.to_owned(),
    }
}

/// An error and every cause under it, one after the other (hyper's own text leaves them out).
fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut next = error.source();
    while let Some(cause) = next {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text = format!("{text}: {cause_text}");
        }
        next = cause.source();
    }
    text
}

/// One request on a connection of its own (plain or TLS).
async fn exchange<S>(
    stream: S,
    endpoint: &str,
    path: &str,
    body: Vec<u8>,
) -> Result<(u16, Bytes), String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| with_hint(&format!("cannot talk HTTP/1.1: {}", chain(&e)), &e))?;
    // The connection lives as long as the request: dropping the set aborts it.
    let mut connection_task = tokio::task::JoinSet::new();
    connection_task.spawn(connection);
    let request = Request::post(path)
        .header(header::HOST, endpoint)
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CONNECTION, "close")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| format!("cannot build the request: {e}"))?;
    let response = sender
        .send_request(request)
        .await
        // A TLS 1.3 server refuses a client certificate only after the handshake: its
        // alert arrives here.
        .map_err(|e| with_hint(&format!("no HTTP answer: {}", chain(&e)), &e))?;
    let status = response.status().as_u16();
    let bytes = Limited::new(response.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
        .map_err(|e| {
            if e.downcast_ref::<LengthLimitError>().is_some() {
                format!("answered more than {} MiB", MAX_BODY_BYTES >> 20)
            } else {
                format!("the answer broke off: {e}")
            }
        })?
        .to_bytes();
    Ok((status, bytes))
}

fn decode<T: DeserializeOwned>(
    endpoint: &str,
    path: &str,
    status: u16,
    bytes: &[u8],
) -> Result<T, StoreError> {
    if let Ok(error) = serde_json::from_slice::<ErrorAnswer>(bytes)
        && (error.code != 0 || !error.message.is_empty())
    {
        return Err(StoreError::Etcd {
            code: error.code,
            message: error.message,
        });
    }
    if !(200..300).contains(&status) {
        return Err(StoreError::Protocol(format!(
            "{endpoint}{path} answered HTTP {status}: {}",
            String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
        )));
    }
    serde_json::from_slice(bytes).map_err(|e| {
        StoreError::Protocol(format!(
            "{endpoint}{path} answered what is not etcd's JSON: {e}"
        ))
    })
}

fn range_request(key: &str, prefix: bool) -> serde_json::Value {
    let mut request = serde_json::json!({ "key": BASE64.encode(key) });
    if prefix {
        request["range_end"] = serde_json::Value::String(BASE64.encode(prefix_end(key)));
    }
    request
}

/// The first key after every key that starts with `prefix` (etcd's `range_end`).
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // Every byte 0xff (or empty): to the end of the keyspace.
    vec![0]
}

fn compare_json(compare: &Compare) -> serde_json::Value {
    match compare {
        Compare::CreateRevision(key, revision) => serde_json::json!({
            "target": "CREATE", "result": "EQUAL", "key": BASE64.encode(key),
            "create_revision": revision.to_string(),
        }),
        Compare::ModRevision(key, revision) => serde_json::json!({
            "target": "MOD", "result": "EQUAL", "key": BASE64.encode(key),
            "mod_revision": revision.to_string(),
        }),
    }
}

fn op_json(op: &Op) -> serde_json::Value {
    match op {
        Op::Put { key, value, lease } => serde_json::json!({ "request_put": {
            "key": BASE64.encode(key), "value": BASE64.encode(value), "lease": lease.to_string(),
        }}),
        Op::Delete { key } => serde_json::json!({ "request_delete_range": {
            "key": BASE64.encode(key),
        }}),
        Op::ListPrefix { prefix } => {
            serde_json::json!({ "request_range": range_request(prefix, true) })
        }
    }
}

/// An int64 as the gateway writes it: a JSON string (or, leniently, a number).
fn int64<'de, D: Deserializer<'de>>(deserializer: D) -> Result<i64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Int64 {
        Text(String),
        Number(i64),
    }
    match Int64::deserialize(deserializer)? {
        Int64::Number(n) => Ok(n),
        Int64::Text(text) => text.parse().map_err(serde::de::Error::custom),
    }
}

#[derive(Debug, Serialize)]
struct PutRequest {
    key: String,
    value: String,
    lease: String,
}

#[derive(Debug, Serialize)]
struct TxnRequest {
    compare: Vec<serde_json::Value>,
    success: Vec<serde_json::Value>,
    failure: Vec<serde_json::Value>,
}

#[derive(Debug, Default, Deserialize)]
struct Header {
    #[serde(default, deserialize_with = "int64")]
    revision: i64,
}

#[derive(Debug, Deserialize)]
struct Ignored {}

#[derive(Debug, Deserialize)]
struct ErrorAnswer {
    #[serde(default)]
    code: i32,
    #[serde(default)]
    message: String,
}

#[derive(Debug, Default, Deserialize)]
struct RangeAnswer {
    #[serde(default)]
    kvs: Vec<WireKeyValue>,
}

#[derive(Debug, Deserialize)]
struct WireKeyValue {
    key: String,
    #[serde(default)]
    value: String,
    #[serde(default, deserialize_with = "int64")]
    create_revision: i64,
    #[serde(default, deserialize_with = "int64")]
    mod_revision: i64,
    #[serde(default, deserialize_with = "int64")]
    lease: i64,
}

impl TryFrom<WireKeyValue> for KeyValue {
    type Error = StoreError;

    fn try_from(wire: WireKeyValue) -> Result<Self, StoreError> {
        let bad = |what: &str, e: base64::DecodeError| {
            StoreError::Protocol(format!("etcd sent a {what} that is not base64: {e}"))
        };
        let key = BASE64.decode(&wire.key).map_err(|e| bad("key", e))?;
        Ok(Self {
            key: String::from_utf8(key)
                .map_err(|_| StoreError::Protocol("etcd sent a key that is not UTF-8".into()))?,
            value: BASE64.decode(&wire.value).map_err(|e| bad("value", e))?,
            create_revision: wire.create_revision,
            mod_revision: wire.mod_revision,
            lease: wire.lease,
        })
    }
}

#[derive(Debug, Deserialize)]
struct TxnAnswer {
    #[serde(default)]
    header: Header,
    #[serde(default)]
    succeeded: bool,
    #[serde(default)]
    responses: Vec<TxnResponse>,
}

#[derive(Debug, Deserialize)]
struct TxnResponse {
    #[serde(default)]
    response_range: Option<RangeAnswer>,
}

#[derive(Debug, Deserialize)]
struct LeaseAnswer {
    #[serde(rename = "ID", default, deserialize_with = "int64")]
    id: i64,
    #[serde(rename = "TTL", default, deserialize_with = "int64")]
    ttl: i64,
}

#[derive(Debug, Deserialize)]
struct KeepAliveAnswer {
    #[serde(default)]
    result: Option<LeaseAnswer>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_ends_at_its_next_key() {
        assert_eq!(prefix_end("/a/"), b"/a0".to_vec());
        assert_eq!(prefix_end("a\u{7f}"), b"a\x80".to_vec());
        assert_eq!(prefix_end(""), vec![0]);
    }

    #[test]
    fn the_gateways_numbers_and_omitted_fields_read_as_etcd_means_them() {
        let answer: TxnAnswer = serde_json::from_str(
            r#"{"header":{"revision":"2"},"responses":[{"response_range":{"kvs":[{"key":"L2E=","create_revision":"2","mod_revision":"2","version":"1","value":"aGk=","lease":"77"}],"count":"1"}}]}"#,
        )
        .expect("parses");
        assert!(!answer.succeeded, "an omitted `succeeded` is false");
        assert_eq!(answer.header.revision, 2);
        let kv = KeyValue::try_from(
            answer
                .responses
                .into_iter()
                .next()
                .and_then(|r| r.response_range)
                .expect("range")
                .kvs
                .remove(0),
        )
        .expect("decodes");
        assert_eq!(
            (kv.key.as_str(), kv.value.as_slice(), kv.lease),
            ("/a", &b"hi"[..], 77)
        );
        let expired: KeepAliveAnswer =
            serde_json::from_str(r#"{"result":{"header":{"revision":"2"},"ID":"123"}}"#)
                .expect("parses");
        assert_eq!(
            expired.result.map(|r| r.ttl),
            Some(0),
            "an omitted TTL is an expired lease"
        );
    }

    #[test]
    fn an_etcd_error_is_named_with_its_code() {
        let error = decode::<Ignored>(
            "h:1",
            "/v3/kv/put",
            404,
            br#"{"error":"etcdserver: requested lease not found","message":"etcdserver: requested lease not found","code":5}"#,
        )
        .expect_err("an error");
        assert!(matches!(error, StoreError::Etcd { code: 5, .. }), "{error}");
    }

    #[test]
    fn an_endpoint_is_http_or_https_host_and_port() {
        for bad in [
            "h:2379",
            "ftp://h:2379",
            "http://h",
            "http://h:1/x",
            "https://:1",
            "http://h:x",
        ] {
            let error = EtcdClient::new(&[bad.to_owned()], Duration::from_secs(1)).expect_err(bad);
            assert!(error.to_string().contains(bad), "{error}");
        }
        EtcdClient::new(
            &["http://127.0.0.1:2379/".to_owned()],
            Duration::from_secs(1),
        )
        .expect("good");
        let v6 = check_endpoint("https://[::1]:2379").expect("IPv6");
        assert_eq!(
            (v6.tls, v6.authority.as_str(), v6.host.as_str()),
            (true, "[::1]:2379", "::1")
        );
    }

    #[test]
    fn https_needs_a_ca_and_a_cluster_is_one_scheme() {
        let error = EtcdClient::new(&["https://h:2379".to_owned()], Duration::from_secs(1))
            .expect_err("no CA");
        assert!(error.to_string().contains("no CA is given"), "{error}");
        let mixed = ["http://a:2379".to_owned(), "https://b:2379".to_owned()];
        let error = check_endpoints(&mixed).expect_err("mixed");
        assert!(error.contains("mix http:// and https://"), "{error}");
        assert!(check_endpoints(&[]).is_err());
    }
}
