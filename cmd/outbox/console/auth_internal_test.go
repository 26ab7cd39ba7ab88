package console

import (
	"testing"
	"time"
)

// A form's CSRF token is good for its user, for csrfTTL, on any console
// with the same credentials.
func TestCSRFToken(t *testing.T) {
	opts := Options{Username: "ops", Password: "pass-0123456789abcdef"}
	a, replica := newAuth(opts), newAuth(opts)
	now := time.Now()
	tok := a.csrfToken("ops", now)
	for _, c := range []struct {
		name string
		ok   bool
		got  bool
	}{
		{"fresh", true, a.checkCSRF(tok, "ops", now)},
		{"on another replica", true, replica.checkCSRF(tok, "ops", now)},
		{"just before expiry", true, a.checkCSRF(tok, "ops", now.Add(csrfTTL-time.Second))},
		{"expired", false, a.checkCSRF(tok, "ops", now.Add(csrfTTL+time.Second))},
		{"issued in the future", false, a.checkCSRF(a.csrfToken("ops", now.Add(time.Hour)), "ops", now)},
		{"another user", false, a.checkCSRF(tok, "token", now)},
		{"other credentials", false, newAuth(Options{Username: "ops", Password: "another-password-0123"}).checkCSRF(tok, "ops", now)},
		{"empty", false, a.checkCSRF("", "ops", now)},
		{"garbage", false, a.checkCSRF("!!!", "ops", now)},
	} {
		if c.got != c.ok {
			t.Errorf("%s: valid = %v, want %v", c.name, c.got, c.ok)
		}
	}
}
