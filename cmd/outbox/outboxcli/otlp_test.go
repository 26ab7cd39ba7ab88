package outboxcli

import (
	"compress/gzip"
	"context"
	"encoding/hex"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	"github.com/outboxhq/outbox"
	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/internal/pgtest"
)

// collector is an in-process OTLP receiver: it keeps the spans of every
// export request it is sent, over HTTP (protobuf) or gRPC.
type collector struct {
	coltracepb.UnimplementedTraceServiceServer
	mu    sync.Mutex
	spans []*tracepb.Span
	attrs map[string]string // resource attributes of the last request
}

func (c *collector) keep(req *coltracepb.ExportTraceServiceRequest) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, rs := range req.GetResourceSpans() {
		c.attrs = map[string]string{}
		for _, kv := range rs.GetResource().GetAttributes() {
			c.attrs[kv.GetKey()] = kv.GetValue().GetStringValue()
		}
		for _, ss := range rs.GetScopeSpans() {
			c.spans = append(c.spans, ss.GetSpans()...)
		}
	}
}

func (c *collector) Export(_ context.Context, req *coltracepb.ExportTraceServiceRequest) (*coltracepb.ExportTraceServiceResponse, error) {
	c.keep(req)
	return &coltracepb.ExportTraceServiceResponse{}, nil
}

func (c *collector) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost || r.URL.Path != "/v1/traces" {
		http.Error(w, "not an OTLP trace export", http.StatusNotFound)
		return
	}
	body := io.Reader(r.Body)
	if r.Header.Get("Content-Encoding") == "gzip" {
		zr, err := gzip.NewReader(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		body = zr
	}
	b, err := io.ReadAll(body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	var req coltracepb.ExportTraceServiceRequest
	if err := proto.Unmarshal(b, &req); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	c.keep(&req)
	resp, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
	w.Header().Set("Content-Type", "application/x-protobuf")
	_, _ = w.Write(resp)
}

func (c *collector) snapshot() ([]*tracepb.Span, map[string]string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]*tracepb.Span(nil), c.spans...), c.attrs
}

// The stock binary exports the relay's publish span over OTLP when the
// standard variables name a collector, and the span continues the trace
// the producer stored with the event.
func TestRelayExportsTraceOverOTLP(t *testing.T) {
	for _, protocol := range []string{"http/protobuf", "grpc"} {
		t.Run(strings.ReplaceAll(protocol, "/", "_"), func(t *testing.T) {
			col := &collector{}
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			if protocol == "grpc" {
				srv := grpc.NewServer()
				coltracepb.RegisterTraceServiceServer(srv, col)
				go func() { _ = srv.Serve(ln) }()
				t.Cleanup(srv.Stop)
			} else {
				srv := &http.Server{Handler: col, ReadHeaderTimeout: 5 * time.Second}
				go func() { _ = srv.Serve(ln) }()
				t.Cleanup(func() { _ = srv.Close() })
			}
			pool, cfg := pgtest.Schema(t)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()

			// The producer's request span, from an SDK of its own.
			producerTP := sdktrace.NewTracerProvider()
			defer func() { _ = producerTP.Shutdown(context.Background()) }()
			pctx, span := producerTP.Tracer("shop").Start(ctx, "POST /orders")
			w, err := outbox.NewWriter(outbox.WriterOptions{Store: cfg, Propagator: propagation.TraceContext{}})
			if err != nil {
				t.Fatal(err)
			}
			if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				return w.Write(pctx, tx, outbox.Message{AggregateID: uuid.NewString(), Type: "order.placed", Payload: map[string]int{"total": 1}})
			}); err != nil {
				t.Fatal(err)
			}
			span.End()
			want := span.SpanContext()

			t.Setenv("OUTBOX_TRACING_ENABLED", "true")
			t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://"+ln.Addr().String())
			t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
			t.Setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
			t.Setenv("OTEL_SERVICE_NAME", "relay-under-test")
			rctx, stop := context.WithCancel(ctx)
			done := make(chan error, 1)
			var stderr string
			go func() {
				var err error
				_, stderr, err = runCLI(rctx, "relay", "--database-url", pgtest.URL(t), "--schema", cfg.Schema, "--broker", "gochannel")
				done <- err
			}()
			waitDispatched(t, ctx, pool, cfg.Schema, 1)
			stop()
			if err := <-done; err != nil {
				t.Fatalf("relay: %v\n%s", err, stderr)
			}
			// The relay flushed its spans on the way out.
			spans, attrs := col.snapshot()
			var publish *tracepb.Span
			for _, s := range spans {
				if strings.HasPrefix(s.GetName(), "publish") {
					publish = s
				}
			}
			if publish == nil {
				t.Fatalf("the collector got no publish span (%d spans)\n%s", len(spans), stderr)
			}
			if got := hex.EncodeToString(publish.GetTraceId()); got != want.TraceID().String() {
				t.Errorf("publish span in trace %s, want the producer's %s", got, want.TraceID())
			}
			if got := hex.EncodeToString(publish.GetParentSpanId()); got != want.SpanID().String() {
				t.Errorf("publish span's parent %s, want the producer's span %s", got, want.SpanID())
			}
			if publish.GetKind() != tracepb.Span_SPAN_KIND_PRODUCER {
				t.Errorf("publish span kind %v, want producer", publish.GetKind())
			}
			if attrs["service.name"] != "relay-under-test" {
				t.Errorf("service.name %q, want OTEL_SERVICE_NAME's", attrs["service.name"])
			}
			if !strings.Contains(stderr, "exporting spans over OTLP") {
				t.Errorf("the relay did not log its exporter:\n%s", stderr)
			}
		})
	}
}

// Without the variables nothing is exported, and a protocol the binary
// lacks is a usage error naming the variable.
func TestOTLPConfiguration(t *testing.T) {
	for _, c := range []struct {
		env  []string
		want bool
	}{
		{nil, false},
		{[]string{"OTEL_EXPORTER_OTLP_ENDPOINT=http://c:4318"}, true},
		{[]string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=http://c:4318/v1/traces"}, true},
		{[]string{"OTEL_TRACES_EXPORTER=otlp"}, true},
		{[]string{"OTEL_EXPORTER_OTLP_ENDPOINT=http://c:4318", "OTEL_TRACES_EXPORTER=none"}, false},
		{[]string{"OTEL_EXPORTER_OTLP_ENDPOINT=http://c:4318", "OTEL_SDK_DISABLED=true"}, false},
	} {
		if got := otlpEnabled(c.env); got != c.want {
			t.Errorf("otlpEnabled(%v) = %v, want %v", c.env, got, c.want)
		}
	}
	_, _, err := newOTLPProvider(context.Background(), []string{"OTEL_EXPORTER_OTLP_ENDPOINT=http://c:4318", "OTEL_EXPORTER_OTLP_PROTOCOL=http/json"})
	if err == nil || !strings.Contains(err.Error(), "OTEL_EXPORTER_OTLP_PROTOCOL") || ExitCode(err) != ExitUsage {
		t.Errorf("http/json: err = %v, want a usage error naming OTEL_EXPORTER_OTLP_PROTOCOL", err)
	}
	_, _, err = newOTLPProvider(context.Background(), []string{"OTEL_TRACES_EXPORTER=zipkin"})
	if err == nil || !strings.Contains(err.Error(), "OTEL_TRACES_EXPORTER") {
		t.Errorf("zipkin: err = %v, want an error naming OTEL_TRACES_EXPORTER", err)
	}
	tp, _, err := newOTLPProvider(context.Background(), nil)
	if tp != nil || err != nil {
		t.Errorf("no variables: provider %v, err %v; want neither", tp, err)
	}
}

// The headers variable carries collector API keys, which are masked.
func TestOTLPHeadersAreSecrets(t *testing.T) {
	got := environSecrets([]string{"OTEL_EXPORTER_OTLP_HEADERS=api-key=k3y-value-1,authorization=Bearer%20t0ken-value-2"})
	for _, want := range []string{"k3y-value-1", "t0ken-value-2", "Bearer t0ken-value-2"} {
		found := false
		for _, s := range got {
			found = found || s == want
		}
		if !found {
			t.Errorf("secrets %q lack %q", got, want)
		}
	}
}

func waitDispatched(t *testing.T, ctx context.Context, pool interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, schema string, n int) {
	t.Helper()
	for {
		var got int
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+pgx.Identifier{schema, "events_outbox"}.Sanitize()+" WHERE dispatched_at IS NOT NULL").Scan(&got); err != nil {
			t.Fatal(err)
		}
		if got >= n {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("%d of %d events dispatched: %v", got, n, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// OTLP configured without tracing.enabled makes no spans, and says so.
func TestOTLPWithoutTracingWarns(t *testing.T) {
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
	var log strings.Builder
	c := Defaults()
	e := &app{cfg: &c, log: newLogger(&log, c.Log), mask: &masker{}}
	pub := &nopPublisher{}
	got, err := wrapTracing(context.Background(), e, pub)
	if err != nil || got != pub {
		t.Fatalf("wrapTracing = %v, %v; want the publisher unwrapped", got, err)
	}
	if !strings.Contains(log.String(), "tracing.enabled is false") {
		t.Errorf("no warning logged:\n%s", log.String())
	}
}

type nopPublisher struct{}

func (*nopPublisher) Publish(context.Context, *core.Event) error { return nil }
func (*nopPublisher) Close() error                               { return nil }
