package kafka

import (
	"encoding/binary"
	"hash"
)

// murmur2 is the hash the Java client's default partitioner applies to
// keys, so this publisher and Java producers send a key to one partition.
type murmur2 struct{ buf []byte }

func newMurmur2() hash.Hash32 { return &murmur2{} }

func (h *murmur2) Write(p []byte) (int, error) { h.buf = append(h.buf, p...); return len(p), nil }
func (h *murmur2) Reset()                      { h.buf = h.buf[:0] }
func (h *murmur2) Size() int                   { return 4 }
func (h *murmur2) BlockSize() int              { return 4 }

func (h *murmur2) Sum(b []byte) []byte { return binary.BigEndian.AppendUint32(b, h.Sum32()) }

func (h *murmur2) Sum32() uint32 {
	const (
		seed = 0x9747b28c
		m    = 0x5bd1e995
		r    = 24
	)
	data := h.buf
	n := len(data)
	x := uint32(seed) ^ uint32(n)
	for i := 0; i+4 <= n; i += 4 {
		k := binary.LittleEndian.Uint32(data[i:])
		k *= m
		k ^= k >> r
		k *= m
		x *= m
		x ^= k
	}
	tail := data[n&^3:]
	switch len(tail) {
	case 3:
		x ^= uint32(tail[2]) << 16
		fallthrough
	case 2:
		x ^= uint32(tail[1]) << 8
		fallthrough
	case 1:
		x ^= uint32(tail[0])
		x *= m
	}
	x ^= x >> 13
	x *= m
	x ^= x >> 15
	return x
}
