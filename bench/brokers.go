package main

import "context"

func (b *bench) brokerSection(ctx context.Context, rep *report) error { return nil }
