//! Certificates for TLS tests, made with the openssl CLI in a folder of their own: a CA,
//! a server certificate for loopback signed by it, a client certificate signed by it, and
//! a second CA that signed nothing here (the wrong CA).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{REQUIRE_ETCD_VAR, free_port, skip_unless_required};

/// A test PKI in a temporary folder, removed when dropped. Keys are EC P-256, PKCS#8 PEM.
#[derive(Debug)]
pub struct TestPki {
    dir: PathBuf,
    /// The CA that signed the server and client certificates.
    pub ca: PathBuf,
    /// For `127.0.0.1` and `localhost`, for server and client use (etcd's own gateway
    /// dials its gRPC server with it).
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    /// A CA that signed none of the above.
    pub other_ca: PathBuf,
    /// A client certificate signed by the other CA (one etcd does not trust).
    pub stranger_cert: PathBuf,
    pub stranger_key: PathBuf,
}

const CA_EXTENSIONS: &str = "basicConstraints=critical,CA:TRUE\nkeyUsage=critical,keyCertSign,cRLSign\nsubjectKeyIdentifier=hash\n";
const SERVER_EXTENSIONS: &str = "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n";
const CLIENT_EXTENSIONS: &str =
    "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n";

impl TestPki {
    /// A fresh PKI; `None` (the test skipped, with the reason) where openssl is not
    /// installed and [`REQUIRE_ETCD_VAR`] is not set (the TLS tests are etcd's).
    ///
    /// # Panics
    ///
    /// Where openssl is there but fails.
    #[track_caller]
    pub fn generate() -> Option<Self> {
        let found = Command::new("openssl")
            .arg("version")
            .output()
            .is_ok_and(|o| o.status.success());
        if !found {
            skip_unless_required(
                REQUIRE_ETCD_VAR,
                "openssl is not installed (apt-get install openssl): no certificates for the TLS tests",
            );
            return None;
        }
        let dir = std::env::temp_dir().join(format!(
            "tokwatt-pki-{}-{}",
            std::process::id(),
            free_port()
        ));
        std::fs::create_dir_all(&dir).expect("the PKI's folder");
        let file = |name: &str| dir.join(name);
        let pki = Self {
            ca: file("ca.pem"),
            server_cert: file("server.pem"),
            server_key: file("server-key.pem"),
            client_cert: file("client.pem"),
            client_key: file("client-key.pem"),
            other_ca: file("other-ca.pem"),
            stranger_cert: file("stranger.pem"),
            stranger_key: file("stranger-key.pem"),
            dir: dir.clone(),
        };
        std::fs::write(file("ca.ext"), CA_EXTENSIONS).expect("write");
        std::fs::write(file("server.ext"), SERVER_EXTENSIONS).expect("write");
        std::fs::write(file("client.ext"), CLIENT_EXTENSIONS).expect("write");
        std::fs::write(file("stranger.ext"), CLIENT_EXTENSIONS).expect("write");
        for (name, cn) in [("ca", "tokwatt test CA"), ("other-ca", "another CA")] {
            key(&dir, &format!("{name}-key.pem"));
            // A self-signed CA: a request signed by its own key, with the CA's extensions.
            csr(&dir, &format!("{name}-key.pem"), cn, &format!("{name}.csr"));
            openssl(
                &dir,
                &[
                    "x509",
                    "-req",
                    "-in",
                    &format!("{name}.csr"),
                    "-signkey",
                    &format!("{name}-key.pem"),
                    "-days",
                    "2",
                    "-extfile",
                    "ca.ext",
                    "-out",
                    &format!("{name}.pem"),
                ],
            );
        }
        for (name, cn, ca, serial) in [
            ("server", "etcd", "ca", "2"),
            ("client", "tokwatt", "ca", "3"),
            ("stranger", "tokwatt", "other-ca", "4"),
        ] {
            key(&dir, &format!("{name}-key.pem"));
            csr(&dir, &format!("{name}-key.pem"), cn, &format!("{name}.csr"));
            openssl(
                &dir,
                &[
                    "x509",
                    "-req",
                    "-in",
                    &format!("{name}.csr"),
                    "-CA",
                    &format!("{ca}.pem"),
                    "-CAkey",
                    &format!("{ca}-key.pem"),
                    "-set_serial",
                    serial,
                    "-days",
                    "2",
                    "-extfile",
                    &format!("{name}.ext"),
                    "-out",
                    &format!("{name}.pem"),
                ],
            );
        }
        Some(pki)
    }

    /// The folder the files are in (a test may write broken copies there).
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

fn key(dir: &Path, out: &str) {
    openssl(
        dir,
        &[
            "genpkey",
            "-algorithm",
            "EC",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-out",
            out,
        ],
    );
}

fn csr(dir: &Path, key: &str, cn: &str, out: &str) {
    openssl(
        dir,
        &[
            "req",
            "-new",
            "-key",
            key,
            "-subj",
            &format!("/CN={cn}"),
            "-out",
            out,
        ],
    );
}

#[track_caller]
fn openssl(dir: &Path, args: &[&str]) {
    let output = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl runs");
    assert!(
        output.status.success(),
        "openssl {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&output.stderr)
    );
}

impl Drop for TestPki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
