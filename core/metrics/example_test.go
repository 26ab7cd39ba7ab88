package metrics_test

import (
	"context"
	"fmt"
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/metrics"
	"github.com/outboxhq/outbox/store/table"
)

// The relay's observer and the backlog poller share one registry, served
// on /metrics.
func Example() {
	reg := prometheus.NewRegistry()
	obs, err := metrics.NewObserver(metrics.Options{Registerer: reg, Broker: "kafka"})
	if err != nil {
		panic(err)
	}
	_ = core.Options{Observer: obs} // given to core.New

	var st *table.Source // from store.New
	if st != nil {
		poller, err := metrics.NewPoller(st, metrics.PollerOptions{Registerer: reg})
		if err != nil {
			panic(err)
		}
		go poller.Run(context.Background())
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	_ = &http.Server{Addr: "127.0.0.1:9090", Handler: mux}
	fmt.Println(metrics.TypePrefix(&core.Event{Type: "order.placed"}))
	// Output: order
}
