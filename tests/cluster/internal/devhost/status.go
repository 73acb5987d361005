package devhost

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"time"
)

// Status is the part of devhost's /status view (docs/features.md) the tests read.
type Status struct {
	Resources []StatusResource `json:"resources"`
}

// StatusResource is one resource of /status.
type StatusResource struct {
	Resource string         `json:"resource"`
	Devices  []StatusDevice `json:"devices"`
}

// StatusDevice is one device of /status: its health, holders, pending release and history.
type StatusDevice struct {
	ID      string          `json:"id"`
	Health  string          `json:"health"`
	Reason  string          `json:"reason"`
	HeldBy  []Holder        `json:"held_by"`
	Release json.RawMessage `json:"release"`
	History []Transition    `json:"history"`
}

// Holder is a container holding a device, as the kubelet's PodResources named it.
type Holder struct {
	Namespace string `json:"namespace"`
	Pod       string `json:"pod"`
	Container string `json:"container"`
}

func (h Holder) String() string { return h.Namespace + "/" + h.Pod + "/" + h.Container }

// Transition is one entry of a device's /status history.
type Transition struct {
	At     string `json:"at"`
	From   string `json:"from"`
	To     string `json:"to"`
	Reason string `json:"reason"`
}

// GetStatus reads http://addr/status.
func GetStatus(addr string) (*Status, error) {
	c := http.Client{Timeout: 10 * time.Second}
	resp, err := c.Get("http://" + addr + "/status")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("/status: HTTP %d: %s", resp.StatusCode, body)
	}
	var s Status
	if err := json.Unmarshal(body, &s); err != nil {
		return nil, fmt.Errorf("/status: %v", err)
	}
	return &s, nil
}

// Device is the device id of resource res in s, or nil.
func (s *Status) Device(res, id string) *StatusDevice {
	for i := range s.Resources {
		if s.Resources[i].Resource != res {
			continue
		}
		for j := range s.Resources[i].Devices {
			if s.Resources[i].Devices[j].ID == id {
				return &s.Resources[i].Devices[j]
			}
		}
	}
	return nil
}
