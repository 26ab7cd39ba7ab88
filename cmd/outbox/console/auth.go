package console

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/binary"
	"mime"
	"net/http"
	"strings"
	"time"
)

// auth decides who a request comes from and what it may do. Credentials
// are compared as hashes in constant time and never logged; the log names
// the user, or "token".
type auth struct {
	opts                      Options
	token, username, password [32]byte
	csrfKey                   []byte
	origin                    *http.CrossOriginProtection
}

func newAuth(o Options) *auth {
	a := &auth{opts: o, origin: http.NewCrossOriginProtection()}
	a.token = sha256.Sum256([]byte(o.Token))
	a.username = sha256.Sum256([]byte(o.Username))
	a.password = sha256.Sum256([]byte(o.Password))
	// Derived from the credentials, so every replica behind one address
	// accepts the forms the others rendered, and changing them voids the
	// forms out there.
	k := sha256.Sum256([]byte("outbox console csrf\x00" + o.Token + "\x00" + o.Username + "\x00" + o.Password))
	a.csrfKey = k[:]
	return a
}

type ctxKey struct{}

// who returns the name of the authenticated caller of r, "" for an
// anonymous one.
func who(r *http.Request) string {
	s, _ := r.Context().Value(ctxKey{}).(string)
	return s
}

func same(a [32]byte, s string) bool {
	h := sha256.Sum256([]byte(s))
	return subtle.ConstantTimeCompare(a[:], h[:]) == 1
}

// identify returns the caller's name, "" when the request carries no
// credentials, and ok false when it carries wrong ones.
func (a *auth) identify(r *http.Request) (name string, ok bool) {
	h := r.Header.Get("Authorization")
	if h == "" {
		return "", true
	}
	if tok, found := strings.CutPrefix(h, "Bearer "); found {
		if a.opts.Token != "" && same(a.token, strings.TrimSpace(tok)) {
			return "token", true
		}
		return "", false
	}
	if u, p, found := r.BasicAuth(); found && a.opts.Username != "" {
		// Both compared, so the time taken does not say which was wrong.
		userOK, passOK := same(a.username, u), same(a.password, p)
		if userOK && passOK {
			return u, true
		}
	}
	return "", false
}

func (a *auth) challenge(w http.ResponseWriter, r *http.Request, msg string) {
	if a.opts.Username != "" {
		w.Header().Add("WWW-Authenticate", `Basic realm="outbox console", charset="UTF-8"`)
	}
	if a.opts.Token != "" {
		w.Header().Add("WWW-Authenticate", `Bearer realm="outbox console"`)
	}
	writeError(w, r, http.StatusUnauthorized, msg)
}

// read lets a request through when its credentials are right, or when it
// has none and anonymous reads are allowed.
func (a *auth) read(h http.HandlerFunc) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		name, ok := a.identify(r)
		switch {
		case !ok:
			a.challenge(w, r, "wrong credentials")
			return
		case name == "" && !a.opts.AnonymousReads:
			a.challenge(w, r, "credentials required")
			return
		}
		h(w, r.WithContext(context.WithValue(r.Context(), ctxKey{}, name)))
	})
}

// Kinds of write request: the API takes JSON, the console's forms take a
// form with a CSRF token.
const (
	apiRequest = iota
	formRequest
)

// maxFormBytes bounds an action's request body.
const maxFormBytes = 1 << 20

// write lets an action through only when it comes from the same origin,
// with right credentials, outside read-only mode, and, for a form, with
// a valid CSRF token, for the API, as JSON (which a cross-site form cannot
// send). Only POST routes use it; a GET never acts.
func (a *auth) write(h http.HandlerFunc, kind int) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if err := a.origin.Check(r); err != nil {
			writeError(w, r, http.StatusForbidden, "cross-origin request refused: "+err.Error())
			return
		}
		name, ok := a.identify(r)
		switch {
		case !ok:
			a.challenge(w, r, "wrong credentials")
			return
		case name == "":
			a.challenge(w, r, "actions need credentials")
			return
		case a.opts.ReadOnly:
			writeError(w, r, http.StatusForbidden, "the console is read-only")
			return
		}
		r.Body = http.MaxBytesReader(w, r.Body, maxFormBytes)
		switch kind {
		case apiRequest:
			if mt, _, _ := mime.ParseMediaType(r.Header.Get("Content-Type")); mt != "application/json" {
				writeError(w, r, http.StatusUnsupportedMediaType, "send the action as application/json")
				return
			}
		case formRequest:
			if err := r.ParseForm(); err != nil {
				writeError(w, r, http.StatusBadRequest, "read form: "+err.Error())
				return
			}
			if !a.checkCSRF(r.PostForm.Get("csrf"), name, time.Now()) {
				writeError(w, r, http.StatusForbidden, "the form's CSRF token is missing, expired or not yours: reload the page and try again")
				return
			}
		}
		h(w, r.WithContext(context.WithValue(r.Context(), ctxKey{}, name)))
	})
}

// login makes a browser ask for the basic-auth credentials, then goes to
// the overview: with anonymous reads on, a browser sends none until asked.
func (a *auth) login() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if name, ok := a.identify(r); ok && name != "" {
			http.Redirect(w, r, "/console/", http.StatusSeeOther)
			return
		}
		if a.opts.Username == "" {
			writeError(w, r, http.StatusForbidden, "no username and password are configured: the console cannot sign a browser in")
			return
		}
		a.challenge(w, r, "sign in to act")
	})
}

// csrfTTL is how long a rendered form stays usable.
const csrfTTL = 12 * time.Hour

// csrfToken is the issue time and an HMAC of it with the caller's name,
// so a token is good for one caller, for csrfTTL, on any replica.
func (a *auth) csrfToken(name string, now time.Time) string {
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], uint64(now.Unix()))
	return base64.RawURLEncoding.EncodeToString(append(b[:], a.csrfMAC(name, b[:])...))
}

func (a *auth) csrfMAC(name string, issued []byte) []byte {
	m := hmac.New(sha256.New, a.csrfKey)
	m.Write([]byte("csrf\x00" + name + "\x00"))
	m.Write(issued)
	return m.Sum(nil)
}

func (a *auth) checkCSRF(tok, name string, now time.Time) bool {
	raw, err := base64.RawURLEncoding.DecodeString(tok)
	if err != nil || len(raw) != 8+sha256.Size {
		return false
	}
	issued := time.Unix(int64(binary.BigEndian.Uint64(raw[:8])), 0)
	if now.Sub(issued) > csrfTTL || issued.After(now.Add(time.Minute)) {
		return false
	}
	return hmac.Equal(raw[8:], a.csrfMAC(name, raw[:8]))
}

// securityHeaders keep the pages out of frames, scripts out of the pages
// and the responses out of caches.
func securityHeaders(h http.Header) {
	h.Set("Content-Security-Policy", "default-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "same-origin")
	h.Set("Cache-Control", "no-store")
}
