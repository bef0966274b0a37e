package taskstore

import "context"

// LeaseKey is the Redis key of task id's lease hash ({owner, epoch}), in
// the task's slot: scripts of other packages that fence a write by the
// lease (the task key's /v1 writes) name it through this.
func LeaseKey(id string) string { return leaseKey(id) }

type leaseCtxKey struct{}

// WithLease returns ctx carrying the lease its run holds, so an executor
// that lets others write for the task (an external agent's /v1 calls) can
// fence those writes by the same owner and epoch.
func WithLease(ctx context.Context, l Lease) context.Context {
	return context.WithValue(ctx, leaseCtxKey{}, l)
}

// LeaseFrom returns the lease WithLease put into ctx.
func LeaseFrom(ctx context.Context) (Lease, bool) {
	l, ok := ctx.Value(leaseCtxKey{}).(Lease)
	return l, ok
}
