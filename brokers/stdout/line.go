package stdout

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"slices"
	"strconv"
	"unicode/utf8"
)

// AppendLine appends l as encoding/json would marshal it, byte for byte,
// without reflection: at the relay's rates the reflective encoder cost
// more than the write. A JSON payload is compacted, so the line holds no
// newline of the payload's own. It fails only for a payload that is not
// valid JSON.
func (l *Line) AppendLine(b []byte) ([]byte, error) {
	b = append(b, `{"seq":`...)
	b = strconv.AppendInt(b, l.Seq, 10)
	b = append(b, `,"event_id":`...)
	b = appendString(b, l.ID)
	b = append(b, `,"aggregate_id":`...)
	b = appendString(b, l.AggregateID)
	b = append(b, `,"type":`...)
	b = appendString(b, l.Type)
	b = append(b, `,"topic":`...)
	b = appendString(b, l.Topic)
	b = append(b, `,"content_type":`...)
	b = appendString(b, l.ContentType)
	if len(l.Payload) > 0 {
		b = append(b, `,"payload":`...)
		buf := bytes.NewBuffer(b)
		if err := json.Compact(buf, l.Payload); err != nil {
			return b, err
		}
		if p := buf.Bytes()[len(b):]; bytes.ContainsAny(p, "<>&\u2028\u2029") {
			// encoding/json escapes these inside a raw message too.
			var esc bytes.Buffer
			json.HTMLEscape(&esc, p)
			b = append(b, esc.Bytes()...)
		} else {
			b = buf.Bytes()
		}
	}
	if len(l.PayloadBase64) > 0 {
		b = append(b, `,"payload_base64":"`...)
		b = base64.StdEncoding.AppendEncode(b, l.PayloadBase64)
		b = append(b, '"')
	}
	if len(l.Headers) > 0 {
		b = append(b, `,"headers":{`...)
		keys := make([]string, 0, len(l.Headers))
		for k := range l.Headers {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		for i, k := range keys {
			if i > 0 {
				b = append(b, ',')
			}
			b = appendString(b, k)
			b = append(b, ':')
			b = appendString(b, l.Headers[k])
		}
		b = append(b, '}')
	}
	return append(b, '}'), nil
}

const hexDigits = "0123456789abcdef"

// appendString appends s quoted as encoding/json quotes strings: HTML
// characters, U+2028 and U+2029 escaped, invalid UTF-8 as U+FFFD.
func appendString(b []byte, s string) []byte {
	b = append(b, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' && c != '<' && c != '>' && c != '&' {
				i++
				continue
			}
			b = append(b, s[start:i]...)
			switch c {
			case '"', '\\':
				b = append(b, '\\', c)
			case '\n':
				b = append(b, '\\', 'n')
			case '\r':
				b = append(b, '\\', 'r')
			case '\t':
				b = append(b, '\\', 't')
			case '\b':
				b = append(b, '\\', 'b')
			case '\f':
				b = append(b, '\\', 'f')
			default:
				b = append(b, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xF])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size == 1:
			b = append(b, s[start:i]...)
			b = append(b, `\ufffd`...)
		case r == '\u2028' || r == '\u2029':
			b = append(b, s[start:i]...)
			b = append(b, '\\', 'u', '2', '0', '2', hexDigits[r&0xF])
		default:
			i += size
			continue
		}
		i += size
		start = i
	}
	return append(append(b, s[start:]...), '"')
}
