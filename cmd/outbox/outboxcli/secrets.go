package outboxcli

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/knadh/koanf/v2"
	"github.com/spf13/cobra"
)

// Credentials are kept out of everything the binary prints in two ways:
// Redact masks anything that looks like one (a URL's password, a
// password= pair), and a masker replaces every value the configuration
// holds as a secret wherever it appears, so a library that quotes a
// setting in its own words is caught too. Every command's stdout, stderr
// (the log) and returned error pass through both.

const mask = "xxxxx"

var (
	// scheme://user:password@host: the password runs to the last @ of the
	// authority.
	urlPassword = regexp.MustCompile(`([A-Za-z][A-Za-z0-9+.\-]*://[^\s:/?#@"]*):[^\s/?#"]*@`)
	// key=value in a keyword/value connection string or a URL query, the
	// value quoted ('a b', with \' escapes) or bare up to a space, & or quote.
	keyValue = regexp.MustCompile(`([A-Za-z0-9_%.\-]+)(\s*=\s*)('(?:[^'\\]|\\.)*'|(?:[^\s&'"\\]|\\.)*)`)
	// "key": "value" in JSON, such as a service account's private_key.
	jsonPair = regexp.MustCompile(`"([A-Za-z0-9_.\-]+)"(\s*:\s*)"(?:[^"\\]|\\.)*"`)
)

// Redact masks the credentials in s, a connection string or any text that
// may hold one: the password of a URL of any scheme
// (postgres://u:xxxxx@h, amqp://...), secret-bearing query parameters and
// keyword/value pairs (password, sslpassword, sasl_password, token and the
// like; see isSecretKey), quoted or not, and such keys in JSON. The rest
// of s is unchanged.
func Redact(s string) string {
	if strings.Contains(s, "://") {
		s = urlPassword.ReplaceAllString(s, "${1}:"+mask+"@")
	}
	if strings.Contains(s, "=") {
		s = keyValue.ReplaceAllStringFunc(s, func(kv string) string {
			m := keyValue.FindStringSubmatch(kv)
			key, err := url.QueryUnescape(m[1])
			if err != nil {
				key = m[1]
			}
			if !isSecretKey(key) {
				return kv
			}
			return m[1] + m[2] + mask
		})
	}
	if strings.Contains(s, `":`) || strings.Contains(s, `" :`) {
		s = jsonPair.ReplaceAllStringFunc(s, func(kv string) string {
			m := jsonPair.FindStringSubmatch(kv)
			if !isSecretKey(m[1]) {
				return kv
			}
			return `"` + m[1] + `"` + m[2] + `"` + mask + `"`
		})
	}
	return s
}

// isSecretKey reports whether a setting, parameter or variable named key
// holds a secret: password, sslpassword, sasl_password, PGPASSWORD,
// client_secret, token, api_key, private_key, credentials_json... but not
// a file that holds one (tls_key_file, credentials_file).
func isSecretKey(key string) bool {
	k := strings.ToLower(key)
	if strings.HasSuffix(k, "file") || strings.HasSuffix(k, "path") {
		return false
	}
	for _, w := range []string{"password", "passwd", "secret", "token", "apikey", "api_key", "private_key", "credentials"} {
		if strings.Contains(k, w) {
			return true
		}
	}
	return k == "pass" || k == "pwd" || strings.HasSuffix(k, "_pass") || strings.HasSuffix(k, "_pwd")
}

// dsnSecrets returns the secrets held in s, a URL (its password and
// secret query parameters) or a keyword/value connection string. It
// works on strings that do not parse, as those are the ones that end up
// quoted in errors.
func dsnSecrets(s string) []string {
	var out []string
	addRaw := func(v string) {
		out = append(out, v)
		if u, err := url.QueryUnescape(v); err == nil {
			out = append(out, u)
		}
	}
	if scheme, rest, ok := strings.Cut(s, "://"); ok && !strings.ContainsAny(scheme, " =") {
		query := ""
		if i := strings.IndexAny(rest, "?#"); i >= 0 {
			rest, query = rest[:i], rest[i:]
		}
		if u, err := url.Parse(s); err == nil && u.User != nil {
			if pw, ok := u.User.Password(); ok {
				out = append(out, pw)
			}
		}
		if at := strings.LastIndex(rest, "@"); at >= 0 {
			if _, pw, ok := strings.Cut(rest[:at], ":"); ok {
				addRaw(pw)
			}
		}
		query, _, _ = strings.Cut(strings.TrimPrefix(query, "?"), "#")
		for kv := range strings.SplitSeq(query, "&") {
			k, v, _ := strings.Cut(kv, "=")
			if key, err := url.QueryUnescape(k); (err == nil && isSecretKey(key)) || isSecretKey(k) {
				addRaw(v)
			}
		}
		return nonEmpty(out)
	}
	for _, kv := range keywordPairs(s) {
		if isSecretKey(kv[0]) {
			out = append(out, kv[1], kv[2])
		}
	}
	return nonEmpty(out)
}

// keywordPairs splits a keyword/value connection string as libpq does:
// key = value, the value bare or in single quotes, with backslash escapes.
// Each pair is key, value and the value as written.
func keywordPairs(s string) [][3]string {
	var pairs [][3]string
	i := 0
	skip := func() {
		for i < len(s) && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r') {
			i++
		}
	}
	for {
		skip()
		start := i
		for i < len(s) && s[i] != '=' && s[i] != ' ' && s[i] != '\t' {
			i++
		}
		key := s[start:i]
		skip()
		if i >= len(s) || s[i] != '=' || key == "" {
			return pairs
		}
		i++
		skip()
		var v strings.Builder
		start = i
		quoted := i < len(s) && s[i] == '\''
		if quoted {
			i++
		}
		for i < len(s) {
			c := s[i]
			if c == '\\' && i+1 < len(s) {
				v.WriteByte(s[i+1])
				i += 2
				continue
			}
			if (quoted && c == '\'') || (!quoted && (c == ' ' || c == '\t' || c == '\n')) {
				break
			}
			v.WriteByte(c)
			i++
		}
		raw := s[start:i]
		if quoted {
			raw = strings.TrimPrefix(raw, "'")
			if i < len(s) {
				i++ // the closing quote
			}
		}
		pairs = append(pairs, [3]string{key, v.String(), raw})
	}
}

func nonEmpty(ss []string) []string {
	return slices.DeleteFunc(ss, func(s string) bool { return s == "" })
}

// environSecrets returns the secrets in the variables the binary reads:
// DATABASE_URL, OUTBOX_* and libpq's PG* (PGPASSWORD, PGSSLPASSWORD).
func environSecrets(environ []string) []string {
	var out []string
	for _, kv := range environ {
		name, v, _ := strings.Cut(kv, "=")
		if name == "OTEL_EXPORTER_OTLP_HEADERS" || name == "OTEL_EXPORTER_OTLP_TRACES_HEADERS" {
			out = append(out, otlpHeaderSecrets(v)...)
			continue
		}
		if name != "DATABASE_URL" && !strings.HasPrefix(name, "OUTBOX_") && !strings.HasPrefix(name, "PG") {
			continue
		}
		if isSecretKey(name) {
			out = append(out, v)
		}
		out = append(out, dsnSecrets(v)...)
	}
	return nonEmpty(out)
}

// otlpHeaderSecrets returns the values of an OTLP headers variable
// ("authorization=Bearer%20x,api-key=y"): collectors take their API keys
// there. Each is masked as written and URL-decoded, as the exporter sends it.
func otlpHeaderSecrets(v string) []string {
	var out []string
	for pair := range strings.SplitSeq(v, ",") {
		_, val, ok := strings.Cut(pair, "=")
		if !ok {
			continue
		}
		val = strings.TrimSpace(val)
		out = append(out, val)
		if dec, err := url.PathUnescape(val); err == nil && dec != val {
			out = append(out, dec)
			// "Bearer x": the token alone may be printed too.
			if _, tok, ok := strings.Cut(dec, " "); ok {
				out = append(out, strings.TrimSpace(tok))
			}
		}
	}
	return nonEmpty(out)
}

// secretsOf returns the secrets of every source loaded into k: the values
// of secret keys (brokers.kafka.sasl_password) and those inside URLs and
// connection strings (database_url, brokers.amqp.url).
func secretsOf(k *koanf.Koanf) []string {
	var out []string
	var add func(key string, v any)
	add = func(key string, v any) {
		switch v := v.(type) {
		case nil:
		case string:
			if isSecretKey(key) {
				out = append(out, v)
			}
			out = append(out, dsnSecrets(v)...)
		case []any:
			for _, e := range v {
				add(key, e)
			}
		case []string:
			for _, e := range v {
				add(key, e)
			}
		default:
			if isSecretKey(key) { // a password YAML read as a number
				out = append(out, fmt.Sprint(v))
			}
		}
	}
	for key, v := range k.All() {
		last := key[strings.LastIndex(key, ".")+1:]
		add(last, v)
	}
	return nonEmpty(out)
}

// minSecret is the shortest secret replaced by value: a shorter one would
// mask every occurrence of a common word or number in the output.
const minSecret = 3

// masker replaces known secrets, in every spelling they may be printed
// in, and then applies Redact. It is safe for concurrent use.
type masker struct {
	mu     sync.RWMutex
	values []string // longest first, so a secret's spellings go before their parts
}

// add makes the masker replace each secret.
func (m *masker) add(secrets ...string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, s := range secrets {
		if len(s) < minSecret {
			continue
		}
		for _, v := range spellings(s) {
			if !slices.Contains(m.values, v) {
				m.values = append(m.values, v)
			}
		}
	}
	slices.SortFunc(m.values, func(a, b string) int { return len(b) - len(a) })
}

// spellings are the forms s takes in URLs, libpq quoting, and quoted
// strings and JSON, twice over: an error that quotes a setting (%q) is
// quoted again when it is logged.
func spellings(s string) []string {
	out := []string{s, url.QueryEscape(s), url.PathEscape(s),
		strings.TrimPrefix(url.UserPassword("", s).String(), ":"),
		strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(s)}
	for range 2 {
		for _, v := range out {
			out = append(out, strings.TrimSuffix(strings.TrimPrefix(strconv.Quote(v), `"`), `"`))
			if b, err := json.Marshal(v); err == nil {
				out = append(out, string(b[1:len(b)-1]))
			}
		}
		slices.Sort(out)
		out = slices.Compact(out)
	}
	return slices.DeleteFunc(out, func(v string) bool { return len(v) < minSecret })
}

// mask returns s with every known secret and anything Redact finds masked.
func (m *masker) mask(s string) string {
	m.mu.RLock()
	for _, v := range m.values {
		s = strings.ReplaceAll(s, v, mask)
	}
	m.mu.RUnlock()
	return Redact(s)
}

// error returns err with a masked message, or nil. The original stays
// reachable with errors.Is and errors.As; its own message is not masked.
func (m *masker) error(err error) error {
	if err == nil {
		return nil
	}
	return &maskedError{msg: m.mask(err.Error()), err: err}
}

type maskedError struct {
	msg string
	err error
}

func (e *maskedError) Error() string { return e.msg }
func (e *maskedError) Unwrap() error { return e.err }

// writer masks each write to w. slog writes a record at a time, and the
// commands a line or a table cell at a time, so a secret is never split
// between writes.
func (m *masker) writer(w io.Writer) io.Writer { return &maskWriter{m: m, w: w} }

type maskWriter struct {
	m *masker
	w io.Writer
}

func (w *maskWriter) Write(p []byte) (int, error) {
	if _, err := io.WriteString(w.w, w.m.mask(string(p))); err != nil {
		return 0, err
	}
	return len(p), nil
}

type maskerKey struct{}

// maskCommands makes c and its subcommands run with m in their context and
// return their errors masked.
func maskCommands(c *cobra.Command, m *masker) {
	if run := c.RunE; run != nil {
		c.RunE = func(cmd *cobra.Command, args []string) error {
			cmd.SetContext(context.WithValue(cmd.Context(), maskerKey{}, m))
			return m.error(run(cmd, args))
		}
	}
	for _, sub := range c.Commands() {
		maskCommands(sub, m)
	}
}

// commandMasker returns the masker of the command line cmd runs in.
func commandMasker(cmd *cobra.Command) *masker {
	if ctx := cmd.Context(); ctx != nil {
		if m, ok := ctx.Value(maskerKey{}).(*masker); ok {
			return m
		}
	}
	return &masker{}
}
