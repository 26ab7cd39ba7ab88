package logrelay

import (
	"strings"
	"testing"

	"github.com/outboxhq/outbox/store"
)

// Default slot names are valid slot names, name the database, and stay
// apart for databases whose names differ only past the cut or in
// characters a slot name cannot hold.
func TestDefaultSlotName(t *testing.T) {
	cfg, err := store.Config{}.WithDefaults()
	if err != nil {
		t.Fatal(err)
	}
	if got, want := defaultSlotName("orders", cfg), "outbox_orders_"+cfg.Schema+"_"+cfg.Table; got != want {
		t.Errorf("default for orders = %q, want %q", got, want)
	}
	long := strings.Repeat("d", 60)
	seen := map[string]string{}
	for _, db := range []string{"orders", "Orders", "order-s", "order_s", long + "1", long + "2"} {
		n := defaultSlotName(db, cfg)
		if !slotName.MatchString(n) {
			t.Errorf("default for %q = %q, not a valid slot name", db, n)
		}
		if other, ok := seen[n]; ok {
			t.Errorf("databases %q and %q share the slot name %q", other, db, n)
		}
		seen[n] = db
	}
	if n := legacySlotName(cfg); n != "outbox_"+cfg.Schema+"_"+cfg.Table {
		t.Errorf("legacy default = %q", n)
	}
}
