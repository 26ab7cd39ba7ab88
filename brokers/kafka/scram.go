package kafka

import (
	"crypto/hmac"
	"crypto/pbkdf2"
	"crypto/rand"
	"crypto/sha256"
	"crypto/sha512"
	"encoding/base64"
	"errors"
	"fmt"
	"hash"
	"strconv"
	"strings"
)

var (
	sha256Hash = sha256.New
	sha512Hash = sha512.New
)

// scram is a SCRAM client (RFC 5802) for Sarama's SASL/SCRAM mechanisms.
// Passwords are used as given, without SASLprep: keep them ASCII.
type scram struct {
	h          func() hash.Hash
	user, pass string
	step       int
	nonce      string
	firstBare  string
	serverSig  []byte
	done       bool
}

func newSCRAM(h func() hash.Hash) *scram { return &scram{h: h} }

func (s *scram) Begin(user, pass, _ string) error {
	s.user, s.pass, s.step, s.done = user, pass, 0, false
	b := make([]byte, 24)
	if _, err := rand.Read(b); err != nil {
		return fmt.Errorf("scram nonce: %w", err)
	}
	s.nonce = base64.RawStdEncoding.EncodeToString(b)
	return nil
}

func (s *scram) Done() bool { return s.done }

func (s *scram) Step(challenge string) (string, error) {
	s.step++
	switch s.step {
	case 1:
		name := strings.NewReplacer("=", "=3D", ",", "=2C").Replace(s.user)
		s.firstBare = "n=" + name + ",r=" + s.nonce
		return "n,," + s.firstBare, nil
	case 2:
		return s.final(challenge)
	case 3:
		s.done = true
		attrs := parseSCRAM(challenge)
		if e, ok := attrs["e"]; ok {
			return "", fmt.Errorf("scram: server refused: %s", e)
		}
		v, err := base64.StdEncoding.DecodeString(attrs["v"])
		if err != nil || !hmac.Equal(v, s.serverSig) {
			return "", errors.New("scram: server signature does not match")
		}
		return "", nil
	}
	return "", errors.New("scram: unexpected challenge")
}

func (s *scram) final(serverFirst string) (string, error) {
	attrs := parseSCRAM(serverFirst)
	nonce := attrs["r"]
	if !strings.HasPrefix(nonce, s.nonce) || len(nonce) == len(s.nonce) {
		return "", errors.New("scram: server nonce does not extend ours")
	}
	salt, err := base64.StdEncoding.DecodeString(attrs["s"])
	if err != nil {
		return "", fmt.Errorf("scram: salt: %w", err)
	}
	iter, err := strconv.Atoi(attrs["i"])
	if err != nil || iter < 1 {
		return "", fmt.Errorf("scram: iteration count %q", attrs["i"])
	}
	salted, err := pbkdf2.Key(s.h, s.pass, salt, iter, s.h().Size())
	if err != nil {
		return "", fmt.Errorf("scram: %w", err)
	}
	clientKey := s.mac(salted, "Client Key")
	stored := s.h()
	stored.Write(clientKey)
	withoutProof := "c=" + base64.StdEncoding.EncodeToString([]byte("n,,")) + ",r=" + nonce
	auth := s.firstBare + "," + serverFirst + "," + withoutProof
	proof := s.mac(stored.Sum(nil), auth)
	for i := range proof {
		proof[i] ^= clientKey[i]
	}
	s.serverSig = s.mac(s.mac(salted, "Server Key"), auth)
	return withoutProof + ",p=" + base64.StdEncoding.EncodeToString(proof), nil
}

func (s *scram) mac(key []byte, msg string) []byte {
	m := hmac.New(s.h, key)
	m.Write([]byte(msg))
	return m.Sum(nil)
}

func parseSCRAM(msg string) map[string]string {
	attrs := map[string]string{}
	for _, kv := range strings.Split(msg, ",") {
		if k, v, ok := strings.Cut(kv, "="); ok {
			attrs[k] = v
		}
	}
	return attrs
}
