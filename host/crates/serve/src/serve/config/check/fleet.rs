//! `[fleet]` and its `[fleet.fence]` and TLS keys, checked by key: called once from
//! [`super::check`].

use super::*;

/// `[fleet]`: every value checked by key. The node's name defaults to the host's; TLS
/// file paths are relative to the config's folder.
pub(super) fn check_fleet(
    raw: RawFleet,
    resolve: &dyn Fn(&Path) -> PathBuf,
) -> Result<FleetConfig, Problem> {
    let endpoints = raw.etcd.get_ref();
    if endpoints.is_empty() {
        return Err(problem(
            "fleet.etcd",
            &raw.etcd,
            "is empty: list the etcd cluster's client URLs, like [\"http://10.0.0.1:2379\"]",
        ));
    }
    let checked = tokwatt_fleet::etcd::check_endpoints(endpoints)
        .map_err(|why| problem("fleet.etcd", &raw.etcd, why))?;
    let tls = check_fleet_tls(&raw, checked[0].tls, resolve)?;
    let name = |key: &'static str, value: &Spanned<String>| {
        if tokwatt_fleet::budget::valid_name(value.get_ref()) {
            Ok(value.get_ref().clone())
        } else {
            Err(problem(
                key,
                value,
                format!(
                    "= \"{}\" cannot be a key: use letters, digits, `-`, `_` and `.`",
                    value.get_ref()
                ),
            ))
        }
    };
    let domain = name("fleet.domain", &raw.domain)?;
    let node = match &raw.node {
        Some(node) => name("fleet.node", node)?,
        None => {
            let host = tokwatt_fleet::budget::host_name();
            if !tokwatt_fleet::budget::valid_name(&host) {
                return Err(missing(
                    "fleet.node",
                    format!(
                        "is not set and the host name `{host}` cannot be a node name: set fleet.node to the name the domain's budget gives this node"
                    ),
                ));
            }
            host
        }
    };
    let reserve_w = *raw.reserve_w.get_ref();
    let optional = |key: &'static str,
                    value: &Option<Spanned<RawDuration>>,
                    default: Duration,
                    accepted: &str| {
        value
            .as_ref()
            .map_or(Ok(default), |v| duration(key, v, accepted))
    };
    let ttl = optional(
        "fleet.lease_ttl",
        &raw.lease_ttl,
        Duration::from_secs(10),
        "at least 2s",
    )?;
    let margin = optional(
        "fleet.margin",
        &raw.margin,
        Duration::from_secs(3),
        "above zero and at least 1s under fleet.lease_ttl",
    )?;
    let report_every = optional(
        "fleet.report_every",
        &raw.report_every,
        Duration::from_secs(1),
        "above zero, fitting twice within fleet.margin",
    )?;
    let timeout = optional(
        "fleet.timeout",
        &raw.timeout,
        Duration::from_secs(1),
        "at most fleet.margin",
    )?;
    let link = tokwatt_fleet::NodeConfig {
        domain,
        node,
        reserve_w,
        ttl,
        margin,
    };
    if let Err(why) = link.check() {
        let (key, value) = if why.contains("reserve") {
            ("fleet.reserve_w", None)
        } else {
            ("fleet.lease_ttl", raw.lease_ttl.as_ref())
        };
        return Err(match value {
            Some(value) => problem(key, value, why),
            None => missing(key, why),
        });
    }
    // Several renewals within the margin: one slow answer is not a lapse.
    if report_every.is_zero() || report_every * 2 > margin || timeout > margin {
        return Err(missing(
            "fleet.report_every",
            format!(
                "({report_every:?}, each request given {timeout:?}) must fit twice within the margin ({margin:?}): a node renews several times before it could drop to its reserve"
            ),
        ));
    }
    let fence = raw
        .fence
        .map(|fence| check_fence(fence, resolve))
        .transpose()?;
    Ok(FleetConfig {
        endpoints: endpoints.clone(),
        tls,
        link,
        report_every,
        timeout,
        fence,
    })
}

/// The longest `fleet.fence.restore_s` taken: beyond it the coordinator would strand a
/// silent node's grant for minutes, and the mechanism is better fixed than waited for.
const MAX_RESTORE_S: f64 = 600.0;

/// `[fleet.fence]`: the kind and the keys it takes, each checked by key.
fn check_fence(raw: RawFence, resolve: &dyn Fn(&Path) -> PathBuf) -> Result<FenceConfig, Problem> {
    let watch = match raw.kind.get_ref().as_str() {
        "systemd-watchdog" => {
            if let Some((key, value)) = [
                ("fleet.fence.heartbeat", &raw.heartbeat),
                ("fleet.fence.status", &raw.status),
            ]
            .into_iter()
            .find_map(|(key, value)| value.as_ref().map(|v| (key, v)))
            {
                return Err(problem(
                    key,
                    value,
                    "applies to kind = \"heartbeat\" (`tokwatt fence`); systemd's watchdog needs no file: remove it, or set kind = \"heartbeat\"",
                ));
            }
            FenceWatch::SystemdWatchdog
        }
        "heartbeat" => {
            let path = |key: &'static str, value: &Option<Spanned<PathBuf>>, what: &str| {
                let Some(value) = value else {
                    return Err(missing(
                        key,
                        format!("is missing: kind = \"heartbeat\" needs {what}"),
                    ));
                };
                if value.get_ref().as_os_str().is_empty() {
                    return Err(problem(key, value, format!("is empty: name {what}")));
                }
                Ok(resolve(value.get_ref()))
            };
            let heartbeat = path(
                "fleet.fence.heartbeat",
                &raw.heartbeat,
                "the file the agent touches after every on-time tick (the one `tokwatt fence --heartbeat` watches)",
            )?;
            let status = path(
                "fleet.fence.status",
                &raw.status,
                "the file `tokwatt fence --status` writes every second (the agent declares the fence only while it is fresh)",
            )?;
            if heartbeat == status {
                return Err(missing(
                    "fleet.fence.status",
                    format!(
                        "is the heartbeat's own file ({}): the agent writes one, the fence the other; name two files",
                        status.display()
                    ),
                ));
            }
            FenceWatch::Heartbeat { heartbeat, status }
        }
        other => {
            return Err(problem(
                "fleet.fence.kind",
                &raw.kind,
                format!(
                    "= \"{other}\": the kinds are \"systemd-watchdog\" (the unit's WatchdogSec=, with Type=notify) and \"heartbeat\" (`tokwatt fence` beside the agent)"
                ),
            ));
        }
    };
    let restore = match &raw.restore_s {
        Some(value) => {
            let seconds = *value.get_ref();
            if !(seconds.is_finite() && seconds > 0.0 && seconds <= MAX_RESTORE_S) {
                return Err(problem(
                    "fleet.fence.restore_s",
                    value,
                    format!(
                        "= {seconds}: the time applying the reserve may take must be a number of seconds above 0 and at most {MAX_RESTORE_S}"
                    ),
                ));
            }
            Duration::from_secs_f64(seconds)
        }
        None => DEFAULT_RESTORE,
    };
    Ok(FenceConfig {
        watch,
        restore,
        covers_reboot: raw.covers_reboot.unwrap_or(false),
    })
}

/// `fleet.fence.restore_s` unset.
const DEFAULT_RESTORE: Duration = Duration::from_secs(10);

/// `fleet.ca_file`, `cert_file` and `key_file`: set together with https:// endpoints
/// (the CA always, the certificate and key both or neither), and each file read and
/// checked now, so a wrong one is named at load rather than at the first connection.
fn check_fleet_tls(
    raw: &RawFleet,
    https: bool,
    resolve: &dyn Fn(&Path) -> PathBuf,
) -> Result<Option<tokwatt_fleet::etcd::TlsFiles>, Problem> {
    use tokwatt_fleet::etcd::{ClientFiles, EtcdTls, TlsFile, TlsFiles};
    let set = [
        ("fleet.ca_file", &raw.ca_file),
        ("fleet.cert_file", &raw.cert_file),
        ("fleet.key_file", &raw.key_file),
    ];
    let Some(ca) = &raw.ca_file else {
        if https {
            return Err(problem(
                "fleet.etcd",
                &raw.etcd,
                "is https:// but fleet.ca_file is not set: name the PEM file of the CA that signed etcd's server certificate (and fleet.cert_file, fleet.key_file where etcd runs with --client-cert-auth)",
            ));
        }
        if let Some((key, Some(value))) = set.iter().find(|(_, v)| v.is_some()) {
            return Err(problem(
                key,
                value,
                "is set without fleet.ca_file: TLS to etcd needs the CA that signed its server certificate, and https:// endpoints",
            ));
        }
        return Ok(None);
    };
    if !https {
        return Err(problem(
            "fleet.ca_file",
            ca,
            "is set but fleet.etcd's endpoints are http://: write the https:// URLs etcd serves TLS on, or leave the TLS keys out",
        ));
    }
    let client = match (&raw.cert_file, &raw.key_file) {
        (Some(cert), Some(key)) => Some(ClientFiles {
            cert_file: resolve(cert.get_ref()),
            key_file: resolve(key.get_ref()),
        }),
        (None, None) => None,
        (Some(cert), None) => {
            return Err(problem(
                "fleet.cert_file",
                cert,
                "is set without fleet.key_file: a client certificate needs its key; set both or neither",
            ));
        }
        (None, Some(key)) => {
            return Err(problem(
                "fleet.key_file",
                key,
                "is set without fleet.cert_file: a client key needs its certificate; set both or neither",
            ));
        }
    };
    let files = TlsFiles {
        ca_file: resolve(ca.get_ref()),
        client,
    };
    if let Err(error) = EtcdTls::load(&files) {
        let (key, value) = match error.file() {
            Some(TlsFile::Cert) => ("fleet.cert_file", raw.cert_file.as_ref()),
            Some(TlsFile::Key) => ("fleet.key_file", raw.key_file.as_ref()),
            Some(TlsFile::Ca) | None => ("fleet.ca_file", Some(ca)),
        };
        let text = format!("names a file that cannot be used: {error}");
        return Err(match value {
            Some(value) => problem(key, value, text),
            None => missing(key, text),
        });
    }
    Ok(Some(files))
}
