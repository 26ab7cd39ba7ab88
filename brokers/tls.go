package brokers

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
)

// TLSFiles are the TLS settings adapters read from configuration. Field
// names in errors are the configuration keys, with the adapter's name in
// front, such as "kafka: tls_ca_file: ...".
type TLSFiles struct {
	CAFile             string // PEM bundle trusted instead of the system roots
	CertFile, KeyFile  string // client certificate, for mutual TLS
	ServerName         string // expected name in the server certificate; default: the host dialled
	InsecureSkipVerify bool   // for tests only: accepts any server certificate
}

// Config loads the files into a client TLS configuration.
func (f TLSFiles) Config() (*tls.Config, error) {
	c := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: f.ServerName, InsecureSkipVerify: f.InsecureSkipVerify} //nolint:gosec // opt-in, documented as test-only
	if f.CAFile != "" {
		pem, err := os.ReadFile(f.CAFile)
		if err != nil {
			return nil, fmt.Errorf("tls_ca_file: %w", err)
		}
		c.RootCAs = x509.NewCertPool()
		if !c.RootCAs.AppendCertsFromPEM(pem) {
			return nil, errors.New("tls_ca_file: no PEM certificate found")
		}
	}
	if (f.CertFile == "") != (f.KeyFile == "") {
		return nil, errors.New("tls_cert_file and tls_key_file go together")
	}
	if f.CertFile != "" {
		cert, err := tls.LoadX509KeyPair(f.CertFile, f.KeyFile)
		if err != nil {
			return nil, fmt.Errorf("tls_cert_file: %w", err)
		}
		c.Certificates = []tls.Certificate{cert}
	}
	return c, nil
}
