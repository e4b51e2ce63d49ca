//! TLS to etcd: the CA that signed etcd's server certificates, and a client certificate
//! for an etcd that checks its clients (`--client-cert-auth`). rustls on ring; the files
//! are PEM, read and checked when loaded, so a wrong file is named before any connection.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::{self, PemObject};
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// The largest TLS file read: a certificate chain or key is a few KiB.
const MAX_FILE_BYTES: u64 = 1024 * 1024;

/// The TLS files for etcd, as the operator names them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The CA (or CAs, one after the other) that signed etcd's server certificates (PEM).
    pub ca_file: PathBuf,
    /// This client's certificate and key, for an etcd started with `--client-cert-auth`.
    pub client: Option<ClientFiles>,
}

/// A client certificate (PEM, the chain after the certificate if any) and its key (PEM).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientFiles {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
}

/// Which of the TLS files a problem is about (serve.toml and the command line name each
/// by its own key).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsFile {
    Ca,
    Cert,
    Key,
}

impl std::fmt::Display for TlsFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Ca => "CA file",
            Self::Cert => "client certificate",
            Self::Key => "client key",
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read the {file} {}: {source}: name an existing PEM file this user may read", path.display())]
    Read {
        file: TlsFile,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the {file} {} is not a regular file of at most 1 MiB: name the PEM file itself", path.display())]
    NotAFile { file: TlsFile, path: PathBuf },
    #[error("the {file} {} is not valid PEM: {why}", path.display())]
    BadPem {
        file: TlsFile,
        path: PathBuf,
        why: String,
    },
    #[error("the {file} {} holds no certificate (-----BEGIN CERTIFICATE-----): name the PEM certificate", path.display())]
    NoCertificate { file: TlsFile, path: PathBuf },
    #[error("the CA file {} holds a certificate that cannot be a trust anchor ({why}): name the CA's own certificate", path.display())]
    BadCa { path: PathBuf, why: String },
    #[error("the client key {} holds no private key (-----BEGIN PRIVATE KEY-----, RSA PRIVATE KEY or EC PRIVATE KEY): name the key the client certificate was issued for", path.display())]
    NoKey { path: PathBuf },
    #[error("the client key {} does not fit the client certificate {} ({why}): name the key the certificate was issued for", key.display(), cert.display())]
    KeyRefused {
        cert: PathBuf,
        key: PathBuf,
        why: String,
    },
    #[error("cannot set up TLS: {0}")]
    Setup(String),
}

impl TlsError {
    /// The file the problem is in (`None`: no one file).
    pub fn file(&self) -> Option<TlsFile> {
        match self {
            Self::Read { file, .. }
            | Self::NotAFile { file, .. }
            | Self::BadPem { file, .. }
            | Self::NoCertificate { file, .. } => Some(*file),
            Self::BadCa { .. } => Some(TlsFile::Ca),
            Self::NoKey { .. } | Self::KeyRefused { .. } => Some(TlsFile::Key),
            Self::Setup(_) => None,
        }
    }
}

/// The loaded TLS setup: shared by every connection of a client (so TLS sessions resume).
#[derive(Clone)]
pub struct EtcdTls {
    config: Arc<rustls::ClientConfig>,
    client_cert: bool,
}

impl std::fmt::Debug for EtcdTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdTls")
            .field("client_cert", &self.client_cert)
            .finish_non_exhaustive()
    }
}

impl EtcdTls {
    /// Reads and checks the files: the CA certificates are trust anchors, the client
    /// certificate and key are PEM and belong together.
    pub fn load(files: &TlsFiles) -> Result<Self, TlsError> {
        let ca = read(TlsFile::Ca, &files.ca_file)?;
        let mut roots = rustls::RootCertStore::empty();
        for cert in certificates(TlsFile::Ca, &files.ca_file, &ca)? {
            roots.add(cert).map_err(|e| TlsError::BadCa {
                path: files.ca_file.clone(),
                why: e.to_string(),
            })?;
        }
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Setup(e.to_string()))?
        .with_root_certificates(roots);
        let config = match &files.client {
            None => builder.with_no_client_auth(),
            Some(client) => {
                let cert = read(TlsFile::Cert, &client.cert_file)?;
                let chain = certificates(TlsFile::Cert, &client.cert_file, &cert)?;
                let key = read(TlsFile::Key, &client.key_file)?;
                let key = match PrivateKeyDer::from_pem_slice(&key) {
                    Ok(key) => key,
                    Err(pem::Error::NoItemsFound) => {
                        return Err(TlsError::NoKey {
                            path: client.key_file.clone(),
                        });
                    }
                    Err(e) => {
                        return Err(TlsError::BadPem {
                            file: TlsFile::Key,
                            path: client.key_file.clone(),
                            why: e.to_string(),
                        });
                    }
                };
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|e| TlsError::KeyRefused {
                        cert: client.cert_file.clone(),
                        key: client.key_file.clone(),
                        why: e.to_string(),
                    })?
            }
        };
        Ok(Self {
            config: Arc::new(config),
            client_cert: files.client.is_some(),
        })
    }

    /// Whether a client certificate is presented.
    pub fn has_client_cert(&self) -> bool {
        self.client_cert
    }

    pub(super) fn connector(&self) -> tokio_rustls::TlsConnector {
        tokio_rustls::TlsConnector::from(Arc::clone(&self.config))
    }
}

/// The file's bytes, bounded: a device or a huge file is refused, not read without end.
fn read(file: TlsFile, path: &Path) -> Result<Vec<u8>, TlsError> {
    let io = |source| TlsError::Read {
        file,
        path: path.to_owned(),
        source,
    };
    let handle = std::fs::File::open(path).map_err(io)?;
    let metadata = handle.metadata().map_err(io)?;
    if !metadata.is_file() || metadata.len() > MAX_FILE_BYTES {
        return Err(TlsError::NotAFile {
            file,
            path: path.to_owned(),
        });
    }
    let mut bytes = Vec::new();
    handle
        .take(MAX_FILE_BYTES)
        .read_to_end(&mut bytes)
        .map_err(io)?;
    Ok(bytes)
}

fn certificates(
    file: TlsFile,
    path: &Path,
    bytes: &[u8],
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::BadPem {
            file,
            path: path.to_owned(),
            why: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            file,
            path: path.to_owned(),
        });
    }
    Ok(certs)
}

/// What to do about a failed TLS connection, where the error says: the hint for the
/// mistakes an operator makes (the wrong CA, no client certificate, a plain member).
pub(super) fn hint(error: &(dyn std::error::Error + 'static)) -> Option<&'static str> {
    use rustls::{AlertDescription as Alert, CertificateError as Cert, Error};
    let mut next = Some(error);
    while let Some(error) = next {
        let tls = error.downcast_ref::<Error>().or_else(|| {
            error
                .downcast_ref::<std::io::Error>()
                .and_then(|io| io.get_ref())
                .and_then(|inner| inner.downcast_ref::<Error>())
        });
        if let Some(tls) = tls {
            return Some(match tls {
                Error::InvalidCertificate(Cert::UnknownIssuer | Cert::BadSignature) => {
                    "etcd's server certificate is not signed by the CA given in fleet.ca_file or --etcd-ca: name the CA that signed etcd's --cert-file"
                }
                Error::InvalidCertificate(
                    Cert::NotValidForName | Cert::NotValidForNameContext { .. },
                ) => {
                    "etcd's server certificate does not name the host of the endpoint: use a name or address its certificate lists (subjectAltName)"
                }
                Error::InvalidCertificate(
                    Cert::Expired
                    | Cert::ExpiredContext { .. }
                    | Cert::NotValidYet
                    | Cert::NotValidYetContext { .. },
                ) => {
                    "etcd's server certificate is expired or not yet valid (or this host's clock is off): renew it"
                }
                Error::AlertReceived(
                    Alert::CertificateRequired | Alert::BadCertificate | Alert::UnknownCA,
                ) => {
                    "etcd requires a client certificate and got none it trusts: set fleet.cert_file and fleet.key_file, or --etcd-cert and --etcd-key, to a certificate signed by the CA in etcd's --trusted-ca-file"
                }
                Error::AlertReceived(Alert::CertificateExpired) => {
                    "etcd refused the client certificate as expired: renew it"
                }
                Error::InvalidMessage(_) => {
                    "the member does not speak TLS: is its client URL http:// rather than https://?"
                }
                _ => return None,
            });
        }
        next = error.source();
    }
    None
}
