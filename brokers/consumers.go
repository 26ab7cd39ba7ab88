package brokers

import (
	"fmt"
	"regexp"
)

// servicePattern fits every broker's naming rules once joined to a topic:
// RabbitMQ queue names, Kafka group ids, Pub/Sub subscription ids (which
// allow letters, digits and "-_.~+%" only).
var servicePattern = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9_-]{0,99}$`)

// CheckService reports whether service can name a consuming service in the
// adapters' SubscriberConfig: its queue, consumer group or subscription,
// which it owns alone so that it gets every event.
func CheckService(service string) error {
	if !servicePattern.MatchString(service) {
		return fmt.Errorf("service %q: want a letter then up to 99 letters, digits, '-' or '_'", service)
	}
	return nil
}
