package walrelay

// LaneOf is laneOf, for tests that place aggregates on lanes.
var LaneOf = laneOf
