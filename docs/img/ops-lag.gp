# Renders ops-lag.png from ops-lag.csv, recorded by
#   OUTBOX_PLOT_DIR=docs/img scripts/services.sh --no-rabbitmq \
#     go test -count=1 -run TestRecordLagTimeline ./metrics/
# Run from docs/img: gnuplot ops-lag.gp
set datafile separator ","
set terminal pngcairo size 1100,720 font "DejaVu Sans,11"
set output "ops-lag.png"
set multiplot layout 3,1 title "outbox relay: healthy, broker outage from 25 s to 50 s, recovery" font ",13"
set grid
set xrange [0:75]
set object 1 rect from 25, graph 0 to 50, graph 1 behind fc rgb "#fde2e2" fs solid noborder
set lmargin 12

set ylabel "seconds"
set title "outbox_oldest_pending_age_seconds  (alert threshold in this run: 10 s)" noenhanced
plot "ops-lag.csv" using 1:3 skip 1 with lines lw 2 lc rgb "#c0392b" title "oldest pending age", \
     10 with lines dt 2 lc rgb "#555555" title "threshold"

set ylabel "events"
set title "outbox_pending_events and outbox_stuck_events  (stuck.after = 15 s)" noenhanced
plot "ops-lag.csv" using 1:2 skip 1 with lines lw 2 lc rgb "#2c7fb8" title "pending", \
     "ops-lag.csv" using 1:4 skip 1 with lines lw 2 lc rgb "#e67e22" title "stuck"

set ylabel "events/s"
set xlabel "time since start (s)"
set logscale y
set yrange [1:10000]
set title "rate(outbox_events_published_total{outcome=\"ok\"})  (producer writes 100/s)" noenhanced
plot "ops-lag.csv" using 1:($5 > 1 ? $5 : 1) skip 1 with steps lw 2 lc rgb "#27ae60" title "published per second"
unset multiplot
