package admin

// SetDispatchedScanRows bounds filtered listings of dispatched events to n
// rows until the returned function restores the bound.
func SetDispatchedScanRows(n int64) (restore func()) {
	old := dispatchedScanRows
	dispatchedScanRows = n
	return func() { dispatchedScanRows = old }
}
