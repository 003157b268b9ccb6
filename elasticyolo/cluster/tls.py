"""What a failed TLS handshake with etcd means: a certificate no retry will fix, or a flaky network.

One place for the rule, used by the etcd client: a certificate problem is a one-line UserError at
once; anything else is transient and retried.
"""

from __future__ import annotations

import re
import socket
import ssl

from elasticyolo.errors import UserError

# OpenSSL reasons that mean "this certificate will never be accepted" (not a flaky network).
_PEER_REFUSED_CERT = ("ALERT_BAD_CERTIFICATE", "ALERT_CERTIFICATE_REQUIRED", "ALERT_UNKNOWN_CA",
                      "ALERT_CERTIFICATE_UNKNOWN", "ALERT_CERTIFICATE_EXPIRED", "ALERT_CERTIFICATE_REVOKED",
                      "ALERT_ACCESS_DENIED")
_WE_REFUSED_CERT = ("CERTIFICATE_VERIFY_FAILED",)


def tls_refusal(exc: BaseException, where: str, has_cert: bool) -> UserError | None:
    """A one-line UserError when a TLS handshake failed over a certificate, else None.
    `where` names the server ("etcd https://10.0.0.5:2379")."""
    text = str(exc)
    m = re.search(r"\[SSL: ([A-Z0-9_]+)\] ([^(]+?)\s*\(_ssl", text)
    code, reason = (m.group(1), m.group(2).strip()) if m else ("", "")
    if any(c in code for c in _PEER_REFUSED_CERT):
        if not has_cert:
            return UserError(f"{where}: TLS handshake refused ({reason}): the server requires a client certificate; "
                             "set etcd_cert and etcd_key")
        return UserError(f"{where}: TLS handshake refused ({reason}): the server does not accept our client "
                         "certificate; use one signed by the cluster CA (etcd_cert, etcd_key)")
    if any(c in code for c in _WE_REFUSED_CERT):
        detail = text.split("certificate verify failed:", 1)[-1].split("(_ssl")[0].strip() or reason
        return UserError(f"{where}: the server's TLS certificate is not trusted ({detail}); set etcd_ca to the "
                         "cluster CA")
    return None


def may_hide_a_refusal(exc: BaseException) -> bool:
    """An EOF or reset in a TLS request. With TLS 1.3 the server judges our client certificate
    after the handshake has finished on our side; when our request crosses its alert, the socket is
    reset and we see only EOF (60 % of tries on an idle host, every try under load), not the alert."""
    text = str(exc)
    return "EOF occurred" in text or "UNEXPECTED_EOF" in text or "Connection reset" in text


def probe_refusal(host: str, port: int, ca: str | None, cert: str | None, key: str | None,
                  timeout: float) -> ssl.SSLError | None:
    """Handshake, send nothing, and read the server's verdict on our certificate: its alert (an
    SSLError) or nothing (None: the server waits for a request, or the network failed)."""
    ctx = ssl.create_default_context(cafile=ca) if ca else ssl.create_default_context()
    if cert and key:
        ctx.load_cert_chain(cert, key)
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw:
            with ctx.wrap_socket(raw, server_hostname=host) as conn:
                conn.recv(1)
    except ssl.SSLError as exc:
        return exc
    except OSError:
        return None
    return None
