package outboxcli

import (
	"time"

	"github.com/outboxhq/outbox/core"
)

// multiObserver fans measurements out to several observers.
type multiObserver []core.Observer

var _ core.Observer = multiObserver(nil)

func (m multiObserver) Claimed(n int, d time.Duration) {
	for _, o := range m {
		o.Claimed(n, d)
	}
}

func (m multiObserver) Published(e *core.Event, d time.Duration, err error) {
	for _, o := range m {
		o.Published(e, d, err)
	}
}

func (m multiObserver) Completed(done, failed int, d time.Duration) {
	for _, o := range m {
		o.Completed(done, failed, d)
	}
}

func (m multiObserver) Rejected(e *core.Event, err error) {
	for _, o := range m {
		o.Rejected(e, err)
	}
}

func (m multiObserver) Errored(op string, err error) {
	for _, o := range m {
		o.Errored(op, err)
	}
}
