package event

import (
	"encoding/json"
	"fmt"
)

// CheckRow applies a relay's checks to the parts of a stored row a broker
// message is made of, and decodes its headers (nil for none). size is
// the row's payload and headers in bytes, as stored; maxEventBytes is the
// relay's limit of it (store.Config.MaxEventBytes). The table's checks
// (migration 7) refuse the rest when the row is written; these are what
// a row written before them, or past them, may still break.
func CheckRow(typ string, headers *string, size int64, maxEventBytes int) (map[string]string, error) {
	if size > int64(maxEventBytes) {
		return nil, fmt.Errorf("payload and headers are %d bytes, over the relay's limit of %d", size, maxEventBytes)
	}
	if err := CheckType(typ); err != nil {
		return nil, fmt.Errorf("type %w", err)
	}
	if headers == nil || *headers == "null" {
		return nil, nil
	}
	if len(*headers) > MaxHeadersBytes {
		return nil, fmt.Errorf("headers are %d bytes, over the limit of %d", len(*headers), MaxHeadersBytes)
	}
	var h map[string]string
	if err := json.Unmarshal([]byte(*headers), &h); err != nil {
		return h, fmt.Errorf("headers are not a JSON object of strings: %s", Truncate(*headers, 200))
	}
	return h, nil
}

// Truncate cuts s to at most n bytes without splitting a UTF-8 sequence.
func Truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && s[n]&0xC0 == 0x80 {
		n--
	}
	return s[:n]
}
