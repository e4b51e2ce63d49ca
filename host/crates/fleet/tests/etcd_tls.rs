//! The fleet's store over TLS, on a real etcd that requires client certificates
//! (`--client-cert-auth`), with certificates made by openssl: it works with the right
//! CA and a client certificate, and each mistake an operator makes is refused by name.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokwatt_fleet::etcd::{ClientFiles, EtcdFleet, EtcdTls, TlsError, TlsFile, TlsFiles};
use tokwatt_fleet::{DomainBudget, FleetStore, NodeBudget, NodeReport, StoreError};
use tokwatt_test_support::{EtcdCluster, TestPki};

const TIMEOUT: Duration = Duration::from_secs(2);

fn budget() -> DomainBudget {
    DomainBudget {
        domain: "rack-tls".into(),
        budget_w: 4000.0,
        uncontrolled_w: 0.0,
        nodes: vec![NodeBudget {
            node: "a".into(),
            reserve_w: 1000.0,
            max_w: 2000.0,
            priority: 0,
            fenced: false,
            default_w: None,
        }],
    }
}

fn files(ca: &Path, client: Option<(&PathBuf, &PathBuf)>) -> TlsFiles {
    TlsFiles {
        ca_file: ca.to_owned(),
        client: client.map(|(cert, key)| ClientFiles {
            cert_file: cert.clone(),
            key_file: key.clone(),
        }),
    }
}

/// The error of reading the domain through a client set up with `tls`.
fn refused(cluster: &EtcdCluster, tls: &TlsFiles) -> String {
    let tls = EtcdTls::load(tls).expect("the files load");
    let store = EtcdFleet::connect_with(&cluster.endpoints(), Some(&tls), TIMEOUT).expect("client");
    match store.read_domain("rack-tls") {
        Err(error @ StoreError::Unavailable(_)) => error.to_string(),
        other => panic!("expected the connection to be refused, got {other:?}"),
    }
}

#[test]
fn the_fleet_works_over_tls_with_a_client_certificate() {
    let Some((pki, cluster)) = EtcdCluster::start_tls_one() else {
        return;
    };
    assert!(cluster.endpoints()[0].starts_with("https://"));
    let tls = EtcdTls::load(&files(&pki.ca, Some((&pki.client_cert, &pki.client_key))))
        .expect("the files load");
    assert!(tls.has_client_cert());
    let store = EtcdFleet::connect_with(&cluster.endpoints(), Some(&tls), TIMEOUT).expect("client");
    assert!(store.client().is_tls());
    store
        .put_budget(&budget())
        .expect("budget written over TLS");
    let session = store
        .join(
            "rack-tls",
            "a",
            Duration::from_secs(30),
            &NodeReport {
                boot: 0,
                acked_generation: 0,
                caps_in_force_w: 1000.0,
                draw_w: 900.0,
                tokens_per_s: 100.0,
                wants_more: false,
                requested_w: 0.0,
                fence: None,
                default_w: 0.0,
            },
        )
        .expect("joins");
    let leader = store
        .campaign("rack-tls", "c1", Duration::from_secs(30))
        .expect("campaign")
        .expect("leads");
    let view = store
        .read_domain("rack-tls")
        .expect("read")
        .expect("a budget");
    assert_eq!(view.budget, budget());
    assert!(view.nodes[0].record.is_some(), "the node's record is there");
    // Many requests, each a connection of its own: the TLS sessions resume.
    for _ in 0..20 {
        assert!(store.renew(&session).expect("renew").is_some());
    }
    store.resign(&leader).expect("resign");
    store.leave(&session).expect("leave");
}

#[test]
fn a_wrong_ca_is_refused_with_the_reason() {
    let Some((pki, cluster)) = EtcdCluster::start_tls_one() else {
        return;
    };
    let error = refused(
        &cluster,
        &files(&pki.other_ca, Some((&pki.client_cert, &pki.client_key))),
    );
    assert!(
        error.contains("TLS handshake failed") && error.contains("not signed by the CA given"),
        "{error}"
    );
}

#[test]
fn no_client_certificate_is_refused_where_etcd_requires_one() {
    let Some((pki, cluster)) = EtcdCluster::start_tls_one() else {
        return;
    };
    let error = refused(&cluster, &files(&pki.ca, None));
    assert!(error.contains("requires a client certificate"), "{error}");
    // A client certificate signed by a CA etcd does not trust is refused too.
    let error = refused(
        &cluster,
        &files(&pki.ca, Some((&pki.stranger_cert, &pki.stranger_key))),
    );
    assert!(error.contains("requires a client certificate"), "{error}");
}

#[test]
fn https_to_a_plain_member_and_http_to_a_tls_member_say_which() {
    let Some((pki, tls_cluster)) = EtcdCluster::start_tls_one() else {
        return;
    };
    let Some(plain) = EtcdCluster::start(1) else {
        return;
    };
    let tls =
        EtcdTls::load(&files(&pki.ca, Some((&pki.client_cert, &pki.client_key)))).expect("loads");
    let as_https: Vec<String> = plain
        .endpoints()
        .iter()
        .map(|e| e.replace("http://", "https://"))
        .collect();
    let store = EtcdFleet::connect_with(&as_https, Some(&tls), TIMEOUT).expect("client");
    let error = store
        .read_domain("rack-tls")
        .expect_err("refused")
        .to_string();
    assert!(error.contains("does not speak TLS"), "{error}");
    let as_http: Vec<String> = tls_cluster
        .endpoints()
        .iter()
        .map(|e| e.replace("https://", "http://"))
        .collect();
    let store = EtcdFleet::connect(&as_http, TIMEOUT).expect("client");
    let error = store
        .read_domain("rack-tls")
        .expect_err("refused")
        .to_string();
    assert!(error.contains("its client URL is https://"), "{error}");
}

#[test]
fn each_bad_tls_file_is_named() {
    let Some(pki) = TestPki::generate() else {
        return;
    };
    let client = Some((&pki.client_cert, &pki.client_key));
    let missing = pki.dir().join("absent.pem");
    let error = EtcdTls::load(&files(&missing, client)).expect_err("no CA file");
    assert_eq!(error.file(), Some(TlsFile::Ca));
    assert!(error.to_string().contains("absent.pem"), "{error}");

    // A key where the CA should be: no certificate in it.
    let error = EtcdTls::load(&files(&pki.client_key, client)).expect_err("a key as CA");
    assert!(
        matches!(
            error,
            TlsError::NoCertificate {
                file: TlsFile::Ca,
                ..
            }
        ),
        "{error}"
    );

    let garbage = pki.dir().join("garbage.pem");
    std::fs::write(
        &garbage,
        "-----BEGIN CERTIFICATE-----\nnot base64 at all!\n",
    )
    .expect("write");
    let error = EtcdTls::load(&files(&garbage, client)).expect_err("broken PEM");
    assert_eq!(error.file(), Some(TlsFile::Ca), "{error}");

    // A certificate where the key should be, and a key that is another certificate's.
    let error = EtcdTls::load(&files(&pki.ca, Some((&pki.client_cert, &pki.client_cert))))
        .expect_err("no key");
    assert!(matches!(error, TlsError::NoKey { .. }), "{error}");
    let error = EtcdTls::load(&files(&pki.ca, Some((&pki.client_cert, &pki.server_key))))
        .expect_err("the wrong key");
    assert!(matches!(error, TlsError::KeyRefused { .. }), "{error}");
    assert!(error.to_string().contains("does not fit"), "{error}");

    let error = EtcdTls::load(&files(
        &pki.ca,
        Some((&pki.dir().to_path_buf(), &pki.client_key)),
    ))
    .expect_err("a folder");
    assert!(
        matches!(
            error,
            TlsError::NotAFile {
                file: TlsFile::Cert,
                ..
            }
        ),
        "{error}"
    );

    // TLS files with http:// endpoints, and https:// endpoints without them, are refused.
    let tls = EtcdTls::load(&files(&pki.ca, client)).expect("loads");
    let error = EtcdFleet::connect_with(&["http://127.0.0.1:2379".into()], Some(&tls), TIMEOUT)
        .expect_err("TLS with http");
    assert!(error.to_string().contains("plain http://"), "{error}");
    let error = EtcdFleet::connect(&["https://127.0.0.1:2379".into()], TIMEOUT)
        .expect_err("https without a CA");
    assert!(error.to_string().contains("no CA is given"), "{error}");
}
