package kafka

// SetBeforeEnd makes p call fn after each transaction's flush, before it
// commits; set it before p publishes.
func SetBeforeEnd(p *TxPublisher, fn func(unit int)) { p.hooks.beforeEnd = fn }
